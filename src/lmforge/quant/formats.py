"""Quantized weight formats as drop-in replacements for a bias-free linear ``y = x Wᵀ``.

Each format is an ``nn.Module`` holding only buffers (no trainable parameters) with the layout
below, a :meth:`dequantize` that rebuilds W (d_out, d_in) in float32, a readable
:meth:`reference` forward (dequantize, then one matmul) and a ``forward`` that takes the fast path
where one applies (the Triton dequant-fused GEMV/GEMM on CUDA, ``torch._scaled_mm`` for fp8
W8A8 on Hopper) and the reference otherwise.

- :class:`Int8Linear`: ``qweight`` int8 (d_out, d_in), ``scales`` fp16 (d_out, d_in/G);
  ``W[n, k] = qweight[n, k] · scales[n, k // G]`` (symmetric, codes in [-127, 127]); G = d_in is
  per-channel, G = 32 is GGUF's Q8_0.
- :class:`Int4Linear`: ``qweight`` uint8 (d_out, d_in/2), two 4-bit codes per byte, packed per
  group of G columns: byte i of group g holds column g·G + i in its low nibble and column
  g·G + G/2 + i in its high nibble (GGUF's Q4_0/Q4_1 block layout at G = 32, and the layout the
  kernels read as two half-tiles). ``scales`` fp16 (d_out, d_in/G); asymmetric formats add
  ``offsets`` fp16 (d_out, d_in/G) and ``W = q · s + m`` (q in 0..15: Q4_1's "d·q + m"); the
  symmetric format has ``W = (q − 8) · s`` (Q4_0).
- :class:`Fp8Linear`: ``qweight`` float8_e4m3fn (d_out, d_in), ``scales`` fp32 (d_out,) per
  channel or (1,) per tensor; ``W = qweight · scales``. ``activations="dynamic"`` is W8A8: each
  row of x gets its own scale (absmax / 448) and is cast to e4m3 too, the product runs as
  ``torch._scaled_mm`` on sm_89+ GPUs (emulated, with the same rounding, elsewhere);
  ``activations="none"`` is weight-only (dequantize, then a matmul in x's dtype). The scale is
  absmax / 448 unless given (:func:`fp8_scales` searches one minimising the weight error).

Every format may carry ``input_scale`` fp32 (d_in,): the forward computes ``(x / input_scale)
Wᵀ`` — the per-input-channel scale of AWQ or SmoothQuant when it could not be folded into the
layer before (see :mod:`lmforge.quant.awq`).

The buffers keep their dtypes under ``module.to(dtype)`` (only device moves apply), so a model
cast to bf16 for serving keeps its codes, fp16 group scales and fp32 fp8 scales.
Shape legend: N = d_out, K = d_in, G group size, M rows of x (all leading dims flattened).
Exercised by ``pytest tests/test_quant_formats.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "FP8_MAX",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantEmbedding",
    "QuantLinear",
    "fp8_scales",
    "int4_codes",
    "int4_params",
    "int4_params_search",
    "pack_int4",
    "unpack_int4",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantLinear(nn.Module):
    """Base of the formats: ``d_in``, ``d_out``, an optional ``input_scale``, dtype-keeping moves."""

    input_scale: torch.Tensor | None

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.register_buffer("input_scale", None)

    def set_input_scale(self, scale: torch.Tensor | None) -> None:
        """Make the forward divide x by ``scale`` (d_in,) per input channel (None: no scale)."""
        self.input_scale = None if scale is None else scale.detach().float().reshape(self.d_in)

    def dequantize(self) -> torch.Tensor:
        """The weights W (d_out, d_in) as float32."""
        raise NotImplementedError

    def _scaled_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is None:
            return x
        return (x.float() / self.input_scale).to(x.dtype)

    # x (M ≤ 8, K) -> (SPLIT, M, N) fp32 split-K partial sums on the dequant-fused decode GEMV
    # (int4, int8), or None: a format without one
    _gemv_partials: Callable[[torch.Tensor], torch.Tensor] | None = None

    def decode_partials(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (M ≤ 8, K) -> the dequant-fused decode GEMV's split-K partial sums (SPLIT, M, N)
        fp32 (their sum over dim 0 is ``self(x)``); None where the format has no GEMV or the
        Triton GEMV does not take x."""
        from lmforge.quant.ops import _GEMV_ROWS, quant_matmul_supported

        if self._gemv_partials is None or x.numel() // x.shape[-1] > _GEMV_ROWS:
            return None
        if not quant_matmul_supported(x, self):
            return None
        return self._gemv_partials(_rows(self._scaled_input(x)))  # (SPLIT, M, N)

    def decode_gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(x)`` for a decode step of ≤ 8 rows: the GEMV's split-K partials out of their
        own op, added and cast in torch (a compiled step folds both into the consumer's kernel);
        None where the format has no GEMV or the Triton GEMV does not take x."""
        parts = self.decode_partials(x)
        if parts is None:
            return None
        return parts.sum(0).to(x.dtype).reshape(*x.shape[:-1], self.d_out)

    # the attributes two modules must share to stack their output rows into one module (None:
    # a format whose rows do not stack, e.g. fp8's per-tensor scale)
    def _stack_key(self) -> tuple | None:
        return None

    def _empty_like(self, d_out: int) -> QuantLinear:
        raise NotImplementedError

    @staticmethod
    def stack_rows(mods: list[QuantLinear]) -> QuantLinear | None:
        """One module whose output is ``cat([m(x) for m in mods], -1)`` — e.g. q/k/v or w1/w3
        as one GEMV in a decode step, as the engine packs plain weights — or None where the
        modules differ in class, input width, group, symmetry, input scale, dtype or device.

        Their buffers with one row per output feature (codes, scales, offsets) are concatenated
        and each module's become row views of the stacked ones, so the weights are held once
        (as :func:`lmforge.serve.compiled.pack_weights` does for plain Linears)."""
        first = mods[0]
        key = first._stack_key()
        if key is None or any(type(m) is not type(first) or m._stack_key() != key for m in mods):
            return None
        s0 = first.input_scale
        if any(
            (m.input_scale is None) != (s0 is None)
            or (s0 is not None and not torch.equal(m.input_scale, s0))
            for m in mods
        ):
            return None
        names = [n for n, b in first._buffers.items() if b is not None and n != "input_scale"]
        for n in names:
            b0 = first._buffers[n]
            for m in mods:
                b = m._buffers.get(n)
                if b is None or b.dtype != b0.dtype or b.device != b0.device:
                    return None
                if b.dim() == 0 or b.shape[0] != m.d_out or b.shape[1:] != b0.shape[1:]:
                    return None
        out = first._empty_like(sum(m.d_out for m in mods))
        with torch.no_grad():
            for n in names:
                rows = torch.cat([m._buffers[n] for m in mods])  # (ΣN, ·)
                out._buffers[n] = rows
                start = 0
                for m in mods:
                    m._buffers[n] = rows[start : start + m.d_out]
                    start += m.d_out
        out.input_scale = s0
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out): dequantize, then ``x Wᵀ`` in x's dtype (the slow truth)."""
        x = self._scaled_input(x)
        return x @ self.dequantize().to(x.dtype).t()  # (..., d_out)

    def weight_bytes(self) -> int:
        """Bytes of every buffer (codes, scales, offsets): what a decode step reads."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        # Apply device moves only: codes, fp16 scales and fp8 weights must survive model.to(bf16).
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)
            self._buffers[name] = moved
        return self

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized (V, D) table: the looked-up rows are dequantized.

    ``table`` is an :class:`Int8Linear` or :class:`Int4Linear` (a GGUF file's Q8_0/Q4 embedding);
    with tied embeddings the LM head is that same module, so the matrix is held once, quantized.
    The output dtype follows ``module.to(dtype)`` like a float embedding's (fp32 by default).
    """

    _probe: torch.Tensor

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.d_out, table.d_in
        # a float buffer that module.to(dtype) casts: it records the dtype to return
        self.register_buffer("_probe", torch.zeros(0), persistent=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(...) long -> (..., D)."""
        t = self.table
        flat = token_ids.reshape(-1)  # (M,)
        g = t.group_size  # type: ignore[attr-defined]
        s = t.scales[flat].float().repeat_interleave(g, dim=1)  # (M, D)
        if isinstance(t, Int4Linear):
            q = unpack_int4(t.qweight[flat], g).float()  # (M, D)
            if t.offsets is None:
                rows = (q - 8.0) * s
            else:
                rows = q * s + t.offsets[flat].float().repeat_interleave(g, dim=1)
        else:
            rows = t.qweight[flat].float() * s  # (M, D)
        return rows.to(self._probe.dtype).reshape(*token_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # (M, K)


# ------------------------------------------------------------------------------------------ int8


class Int8Linear(QuantLinear):
    """Symmetric int8 weights with one fp16 scale per (output row, group of G inputs)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, d_in: int, d_out: int, group_size: int | None = None) -> None:
        super().__init__(d_in, d_out)
        g = d_in if group_size is None else group_size
        if d_in % g:
            raise ValueError(f"group size {g} does not divide d_in {d_in}")
        self.group_size = g
        self.register_buffer("qweight", torch.zeros(d_out, d_in, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(d_out, d_in // g, dtype=torch.float16))

    def _stack_key(self) -> tuple | None:
        return (self.d_in, self.group_size)

    def _empty_like(self, d_out: int) -> Int8Linear:
        return Int8Linear(self.d_in, d_out, self.group_size)

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int | None = None) -> Int8Linear:
        """Round-to-nearest: scale = absmax / 127 per (row, group)."""
        d_out, d_in = weight.shape
        m = cls(d_in, d_out, group_size)
        g = m.group_size
        w = weight.detach().float().reshape(d_out, d_in // g, g)  # (N, K/G, G)
        s = (w.abs().amax(-1) / 127.0).clamp_min(1e-8).half()  # (N, K/G)
        q = torch.round(w / s.float()[..., None]).clamp(-127, 127)  # (N, K/G, G)
        m.qweight = q.reshape(d_out, d_in).to(torch.int8).to(weight.device)
        m.scales = s.to(weight.device)
        return m

    def dequantize(self) -> torch.Tensor:
        n, k = self.qweight.shape
        q = self.qweight.float().reshape(n, k // self.group_size, self.group_size)  # (N, K/G, G)
        return (q * self.scales.float()[..., None]).reshape(n, k)  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        from lmforge.quant.ops import quant_matmul_supported

        if quant_matmul_supported(x, self):
            x = self._scaled_input(x)
            y = torch.ops.lmforge_quant.int8_matmul(_rows(x), self.qweight, self.scales)
            return y.reshape(*x.shape[:-1], self.d_out)
        return self.reference(x)

    def _gemv_partials(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.lmforge_quant.int8_gemv_partials(x, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


# ------------------------------------------------------------------------------------------ int4


def int4_params(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest parameters per (row, group): ``(scales, offsets)``, fp16 (N, K/G).

    Asymmetric: ``s = (max − min) / 15``, ``m = min`` (each rounded to fp16 first, so the codes
    are chosen against the parameters that are stored). Symmetric: ``s = absmax / 7``, no offsets
    (codes q − 8 in [-8, 7]).
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, K/G, G)
    if symmetric:
        s = (w.abs().amax(-1) / 7.0).clamp_min(1e-8).half()  # (N, K/G)
        return s, None
    lo, hi = w.amin(-1), w.amax(-1)  # (N, K/G)
    s = ((hi - lo) / 15.0).clamp_min(1e-8).half()  # (N, K/G)
    return s, lo.half()


def int4_params_search(
    weight: torch.Tensor,
    group_size: int,
    symmetric: bool,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
    col_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip-searched parameters per (row, group), fp16 (N, K/G) like :func:`int4_params`.

    GPTQ's ``mse`` option (also AutoGPTQ/GPTQModel's): the min/max range is shrunk by factors
    p = 1, 1 − 1/grid, …, 1 − max_shrink (``[p·min, p·max]``, or ``p·absmax`` symmetric) and each
    (row, group) keeps the p with the smallest ``Σ_k c_k |w_k − Q(w_k)|^norm`` (c = ``col_weight``
    (K,), e.g. diag H, or 1). p = 1 is min/max, so the error never exceeds :func:`int4_params`'s.
    """
    n, k = weight.shape
    ng = k // group_size
    w = weight.detach().float().reshape(n, ng, group_size)  # (N, K/G, G)
    c = torch.ones(k, device=w.device) if col_weight is None else col_weight.float().to(w.device)
    c = c.reshape(1, ng, group_size)  # (1, K/G, G)
    best_s, best_m = int4_params(weight, group_size, symmetric)
    best_err = _int4_err(w, best_s, best_m, c, norm)  # (N, K/G)
    lo, hi = w.amin(-1), w.amax(-1)  # (N, K/G)
    amax = w.abs().amax(-1)
    for i in range(1, int(max_shrink * grid) + 1):
        p = 1.0 - i / grid
        if symmetric:
            s, m = (p * amax / 7.0).clamp_min(1e-8).half(), None
        else:
            s, m = ((p * (hi - lo)) / 15.0).clamp_min(1e-8).half(), (p * lo).half()
        err = _int4_err(w, s, m, c, norm)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        if m is not None:
            best_m = torch.where(better, m, best_m)  # type: ignore[arg-type]
    return best_s, best_m


def _int4_err(
    w: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, c: torch.Tensor, norm: float
) -> torch.Tensor:
    """(N, K/G) weighted error Σ c |w − Q(w)|^norm of w (N, K/G, G) under (s, m) (N, K/G)."""
    sf = s.float()[..., None]
    if m is None:
        dq = ((torch.round(w / sf) + 8).clamp(0, 15) - 8) * sf
    else:
        mf = m.float()[..., None]
        dq = torch.round((w - mf) / sf).clamp(0, 15) * sf + mf
    return ((w - dq).abs().pow(norm) * c).sum(-1)


def int4_codes(
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """Codes 0..15 (N, K) uint8 of ``weight`` under the given parameters (round to nearest)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, K/G, G)
    s = scales.float()[..., None]  # (N, K/G, 1)
    if offsets is None:
        q = torch.round(w / s) + 8
    else:
        q = torch.round((w - offsets.float()[..., None]) / s)
    return q.clamp(0, 15).reshape(n, k).to(torch.uint8)  # (N, K)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) bytes in the per-group half-split layout (module doc)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // group_size, 2, group_size // 2)  # (N, K/G, 2, G/2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)  # (N, K/2)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K/2) bytes -> (N, K) codes 0..15 (inverse of :func:`pack_int4`)."""
    n, half = packed.shape
    p = packed.reshape(n, -1, 1, group_size // 2)  # (N, K/G, 1, G/2)
    both = torch.cat([p & 0x0F, p >> 4], dim=2)  # (N, K/G, 2, G/2)
    return both.reshape(n, 2 * half)  # (N, K)


class Int4Linear(QuantLinear):
    """Group-wise 4-bit weights, two per byte; asymmetric (scale + offset) or symmetric."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(
        self, d_in: int, d_out: int, group_size: int = 128, symmetric: bool = False
    ) -> None:
        super().__init__(d_in, d_out)
        if group_size % 2 or d_in % group_size:
            raise ValueError(f"group size {group_size} must be even and divide d_in {d_in}")
        self.group_size = group_size
        self.symmetric = symmetric
        ng = d_in // group_size
        self.register_buffer("qweight", torch.zeros(d_out, d_in // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(d_out, ng, dtype=torch.float16))
        offsets = None if symmetric else torch.zeros(d_out, ng, dtype=torch.float16)
        self.register_buffer("offsets", offsets)

    def _stack_key(self) -> tuple | None:
        return (self.d_in, self.group_size, self.symmetric)

    def _empty_like(self, d_out: int) -> Int4Linear:
        return Int4Linear(self.d_in, d_out, self.group_size, self.symmetric)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
    ) -> Int4Linear:
        """A module from codes (N, K) 0..15 and their fp16 parameters (N, K/G)."""
        d_out, d_in = codes.shape
        m = cls(d_in, d_out, group_size, symmetric=offsets is None)
        m.qweight = pack_int4(codes, group_size)
        m.scales = scales.half()
        m.offsets = None if offsets is None else offsets.half()
        return m

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, group_size: int = 128, symmetric: bool = False
    ) -> Int4Linear:
        """Round-to-nearest with :func:`int4_params`."""
        s, m = int4_params(weight, group_size, symmetric)
        return cls.from_codes(int4_codes(weight, s, m, group_size), s, m, group_size)

    def codes(self) -> torch.Tensor:
        """The unpacked codes (N, K) 0..15."""
        return unpack_int4(self.qweight, self.group_size)

    def dequantize(self) -> torch.Tensor:
        n, k, g = self.d_out, self.d_in, self.group_size
        q = self.codes().float().reshape(n, k // g, g)  # (N, K/G, G)
        s = self.scales.float()[..., None]  # (N, K/G, 1)
        if self.offsets is None:
            w = (q - 8.0) * s
        else:
            w = q * s + self.offsets.float()[..., None]
        return w.reshape(n, k)  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        from lmforge.quant.ops import quant_matmul_supported

        if quant_matmul_supported(x, self):
            x = self._scaled_input(x)
            y = torch.ops.lmforge_quant.int4_matmul(
                _rows(x), self.qweight, self.scales, self.offsets, self.group_size
            )
            return y.reshape(*x.shape[:-1], self.d_out)
        return self.reference(x)

    def _gemv_partials(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.lmforge_quant.int4_gemv_partials(
            x, self.qweight, self.scales, self.offsets, self.group_size
        )

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{super().extra_repr()}, group_size={self.group_size}, {kind}"


# ------------------------------------------------------------------------------------------- fp8


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row fp8: ``(x / s).to(e4m3)`` with s = absmax(row) / 448; returns (codes, s (M, 1))."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # (M, 1)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_scales(
    weight: torch.Tensor,
    per_channel: bool = True,
    grid: int = 0,
    col_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 scales (N,) per channel or (1,) per tensor of ``weight`` (N, K) for e4m3 codes.

    ``grid = 0``: absmax / 448. Otherwise a search: the candidates are s = absmax / (448 c) for
    c = 1, 1 − 1/(2·grid), …, down to just above 1/2 (e4m3 is the same grid at twice the scale,
    so c in (1/2, 1] covers every alignment of the values against the grid without clipping),
    and each row (or the tensor) keeps the s with the smallest ``Σ_k c_k (w_k − Q(w_k))²``
    (c = ``col_weight`` (K,), e.g. the mean squared input of column k, or 1). c = 1 is absmax,
    so the error never exceeds it.
    """
    w = weight.detach().float()
    amax = w.abs().amax(-1) if per_channel else w.abs().amax().reshape(1)  # (N,) | (1,)
    s0 = (amax / FP8_MAX).clamp_min(1e-12)
    if not grid:
        return s0
    c = torch.ones(w.shape[1], device=w.device) if col_weight is None else col_weight.float()
    c = c.to(w.device)

    def err(s: torch.Tensor) -> torch.Tensor:
        q = (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        e = ((q * s[:, None] - w).pow(2) * c).sum(-1)  # (N,)
        return e if per_channel else e.sum().reshape(1)

    best_s, best = s0, err(s0)
    for i in range(1, grid):
        s = s0 / (1.0 - i / (2 * grid))
        e = err(s)
        better = e < best
        best, best_s = torch.where(better, e, best), torch.where(better, s, best_s)
    return best_s


class Fp8Linear(QuantLinear):
    """float8 e4m3 weights with per-channel or per-tensor fp32 scales; W8A8 or weight-only."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, d_in: int, d_out: int, per_channel: bool = True, activations: str = "dynamic"
    ) -> None:
        super().__init__(d_in, d_out)
        if activations not in ("dynamic", "none"):
            raise ValueError(f"activations must be dynamic or none, got {activations!r}")
        self.per_channel = per_channel
        self.activations = activations
        w = torch.zeros(d_out, d_in, dtype=torch.float8_e4m3fn)
        self.register_buffer("qweight", w)
        self.register_buffer("scales", torch.ones(d_out if per_channel else 1))

    def _stack_key(self) -> tuple | None:  # a per-tensor scale is one number per module
        return (self.d_in, self.activations) if self.per_channel else None

    def _empty_like(self, d_out: int) -> Fp8Linear:
        return Fp8Linear(self.d_in, d_out, self.per_channel, self.activations)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        per_channel: bool = True,
        activations: str = "dynamic",
        scales: torch.Tensor | None = None,
    ) -> Fp8Linear:
        """Codes = W / scale cast to e4m3; scale = absmax / 448 per row (or over the tensor)
        unless ``scales`` (N,) | (1,) are given (e.g. :func:`fp8_scales`' search)."""
        d_out, d_in = weight.shape
        m = cls(d_in, d_out, per_channel, activations)
        w = weight.detach().float()
        s = fp8_scales(w, per_channel) if scales is None else scales.float().to(w.device)
        m.qweight = (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        m.scales = s
        return m

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]  # (N, K)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Weight-only: x Wᵀ in x's dtype. W8A8: x rounded to per-row e4m3 first, fp32 product."""
        x = self._scaled_input(x)
        if self.activations == "none":
            return x @ self.dequantize().to(x.dtype).t()  # (..., N)
        xq, sx = fp8_quantize_rows(_rows(x))  # (M, K), (M, 1)
        y = (xq.float() * sx) @ self.dequantize().t()  # (M, N)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.d_out)

    def _scaled_mm_ok(self, x: torch.Tensor) -> bool:
        if self.activations != "dynamic" or not x.is_cuda or not hasattr(torch, "_scaled_mm"):
            return False
        if x.dtype not in (torch.bfloat16, torch.float16):
            return False
        return torch.cuda.get_device_capability(x.device) >= (8, 9) and self.d_in % 16 == 0 == (
            self.d_out % 16
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        if not self._scaled_mm_ok(x):
            return self.reference(x)
        x = self._scaled_input(x)
        xq, sx = fp8_quantize_rows(_rows(x))  # (M, K) e4m3, (M, 1)
        sw = self.scales.float().expand(self.d_out).reshape(1, self.d_out).contiguous()  # (1, N)
        # row-wise scales (one per token, one per output channel) need a bf16 output
        y = torch._scaled_mm(
            xq, self.qweight.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16
        )  # (M, N)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.d_out)

    @property
    def _gemv_partials(self) -> Callable[[torch.Tensor], torch.Tensor] | None:  # type: ignore[override]
        """The batch-1 fp8 GEMV where the GPU sweep measured it faster than ``torch._scaled_mm``
        for this shape (an ("fp8", N, K, K) entry of ``lmforge.quant._gemv_triton.TABLE``);
        else None, and decode steps keep :meth:`forward`."""
        from lmforge.quant._gemv_triton import TABLE

        return self._fp8_partials if ("fp8", self.d_out, self.d_in, self.d_in) in TABLE else None

    def _fp8_partials(self, x: torch.Tensor) -> torch.Tensor:
        """x (1, K) -> (SPLIT, 1, N) fp32 partials of :meth:`reference`'s product: W8A8 rounds
        the row to e4m3 first (its scale applied after the sum, as ``_scaled_mm`` does)."""
        if self.activations == "dynamic":
            xq, sx = fp8_quantize_rows(x)  # (1, K) e4m3, (1, 1)
            return torch.ops.lmforge_quant.fp8_gemv_partials(
                xq, self.qweight, self.scales, sx.reshape(1)
            )
        return torch.ops.lmforge_quant.fp8_gemv_partials(x, self.qweight, self.scales, None)

    def decode_partials(self, x: torch.Tensor) -> torch.Tensor | None:
        """Batch 1 (one row of x) on the fp8 GEMV where :attr:`_gemv_partials` has it, else
        None (larger batches and unswept shapes keep ``_scaled_mm``)."""
        from lmforge.quant.ops import quant_matmul_supported

        fn = self._gemv_partials
        if fn is None or x.numel() != x.shape[-1] or not quant_matmul_supported(x, self):
            return None
        return fn(_rows(self._scaled_input(x)))  # (SPLIT, 1, N)

    def extra_repr(self) -> str:
        per = "per-channel" if self.per_channel else "per-tensor"
        return f"{super().extra_repr()}, {per}, activations={self.activations}"
