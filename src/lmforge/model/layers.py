"""The model's building blocks, written out as plain tensor math.

The reference path uses none of ``nn.Linear``, ``nn.Embedding``, ``nn.RMSNorm`` or
``F.scaled_dot_product_attention``: every block here is its own few lines, so a reader sees the
whole computation and faster paths (torch SDPA, lmforge's Triton kernels) have an obvious
reference to be tested against. Exercised by ``pytest tests/test_model_layers.py``.

Shape legend (all of ``lmforge.model``): B batch, T sequence (queries), S key/value slots,
D model dim, H query heads, K kv-heads, E head dim, V vocab, F ffn dim; ``...`` any leading dims.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from lmforge.model.config import default_d_ff


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Fill ``weight`` from N(0, std²) truncated at ±3·std (in place, no autograd)."""
    with torch.no_grad():
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)


class Linear(nn.Module):
    """``y = x Wᵀ`` without bias; ``weight`` is (d_out, d_in) like ``nn.Linear``.

    Init: truncated normal with σ = sqrt(2 / (d_in + d_out)) clipped at ±3σ (Glorot-style variance,
    which keeps activations near unit scale for the square-ish matrices of a Transformer).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_in = d_in
        self.d_out = d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def init_std(self) -> float:
        """σ of the initial weights."""
        return math.sqrt(2.0 / (self.d_in + self.d_out))

    def reset_parameters(self) -> None:
        """Re-draw the weights (deterministic under ``torch.manual_seed``)."""
        _trunc_normal_(self.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        return project(x, self.weight)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.t()``, for a Linear's own weight or a concatenation of several (one GEMM for
    several projections)."""
    # matmul with the transposed view lets autocast pick the bf16 kernel and keeps the
    # (d_out, d_in) layout that HF and nn.Linear checkpoints use.
    return x @ weight.t()  # (..., d_out)


def _bare(m: nn.Module) -> bool:
    """Whether calling ``m`` runs nothing but its class's ``forward``: no per-instance
    ``forward``, no hooks of its own and none of torch's global module hooks."""
    hooks = _torch_module
    if (
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    ):
        return False
    if "forward" in m.__dict__:
        return False
    return not (
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


def _fusable(*linears: nn.Module) -> bool:
    """Whether one matmul against the concatenated weights of ``linears`` computes exactly what
    calling each module on the same input does.

    The rule: every module is a plain :class:`Linear` (not a subclass, no per-instance
    ``forward``), none has forward/backward (pre-)hooks and torch's global module hooks are empty
    (``Module.__call__`` would run none, so skipping it changes nothing; tensor parallelism's
    ``copy_to_tp``/``reduce_from_tp`` are such hooks), and the weights share one dtype and one
    device. Otherwise callers call the modules one by one. A few dict/attribute checks per call;
    ``torch.compile`` evaluates them while tracing (no graph break), so, as for any module hook
    under compile, hooks must be registered before compiling (tensor parallelism is applied first).
    """
    if any(type(m) is not Linear for m in linears):  # e.g. a quantized linear: call it
        return False
    if not all(_bare(m) for m in linears):
        return False
    first = linears[0].weight
    for m in linears:
        w = m.weight
        if w.dtype != first.dtype or w.device != first.device:
            return False
    return True


def _cat_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(weights)`` along dim 0 (output rows), in autocast's dtype when it is on.

    Autocast would cast the concatenation for the matmul anyway (same values: rounding is
    elementwise); casting the pieces first spares writing a full-precision copy of the
    concatenated weights, in eager mode and in the kernel Inductor generates.
    """
    first = weights[0]
    device_type = first.device.type
    if (
        device_type in ("cuda", "cpu")
        and torch.is_autocast_enabled(device_type)
        and first.is_floating_point()
        and first.dtype != torch.float64  # autocast leaves float64 alone
    ):
        dtype = torch.get_autocast_dtype(device_type)
        weights = [w.to(dtype) for w in weights]
    return torch.cat(weights)


class Embedding(nn.Module):
    """Row lookup into a (num_embeddings, embedding_dim) matrix.

    Init: truncated normal N(0, 1) clipped at ±3 (the model re-initialises it with the LM head's
    smaller σ when the two share weights; see :class:`lmforge.model.TransformerLM`).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the weights (deterministic under ``torch.manual_seed``)."""
        _trunc_normal_(self.weight, 1.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(...) long -> (..., D)."""
        return self.weight[token_ids]  # (..., D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight``, computed in fp32 and cast back to x's dtype.

    fp32 matters under bf16 autocast: the mean of squares over D entries loses most of its digits
    in bf16. The weight starts at ones.
    """

    def __init__(
        self,
        d_model: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """Set the gain back to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        in_dtype = x.dtype
        x32 = x.float()
        rms_inv = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rms_inv * self.weight.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU / swish: ``x · sigmoid(x)``."""
    return x * torch.sigmoid(x)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax along ``dim``, stable for large inputs (subtracts the max before ``exp``).

    A row that is entirely ``-inf`` yields NaN, as ``torch.softmax`` does; the attention masks in
    lmforge always leave each query at least one key.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(shifted)
    return e / e.sum(dim=dim, keepdim=True)


class SwiGLU(nn.Module):
    """Gated feed-forward ``w2(silu(w1 x) ⊙ w3 x)`` (Shazeer 2020), no biases.

    ``d_ff`` defaults to 8/3·d_model rounded up to a multiple of 64, which keeps the parameter
    count of a 4·d_model ReLU MLP while staying friendly to matmul tiling.

    The packed fast path (one GEMM for w1 and w3, lmforge's Triton gate) lives in
    :class:`lmforge.model.transformer._FFN`; this is its reference.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_ff = default_d_ff(d_model) if d_ff is None else d_ff
        self.d_model = d_model
        self.d_ff = d_ff
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        gate, up = self.w1(x), self.w3(x)  # (..., F) each
        return self.w2(silu(gate) * up)  # (..., F) -> (..., D)


def llama3_scaled_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling of ``inv_freq`` (E/2,): a pure function.

    Wavelengths ``2π / f`` shorter than ``original_context / high_freq_factor`` keep their
    frequency (they already resolve positions within the original window); those longer than
    ``original_context / low_freq_factor`` are divided by ``factor`` (stretched to the longer
    context); in between, a linear blend in ``original_context / wavelength``.
    """
    wavelen = 2 * math.pi / inv_freq  # (E/2,)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelen < original_context / high_freq_factor, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer; Meta's Llama layout).

    Consecutive pairs ``(x[2i], x[2i+1])`` of each head vector are rotated by the angle
    ``position · θ^(−2i/d_k)``. This is the interleaved layout of the RoFormer paper and Meta's
    reference Llama code; Hugging Face's "rotate half" layout pairs ``x[i]`` with ``x[i + d_k/2]``
    instead, so an HF export permutes the rows of the q/k projections.

    cos/sin tables for positions ``0 .. max_seq_len-1`` are precomputed in fp32 and held as
    non-persistent buffers: they never appear in a state dict, and :meth:`reset_parameters`
    rebuilds them (needed after materialising a model created on the meta device).

    ``mrope_sections`` (t, h, w), summing to E/2, turns on Qwen2-VL's multimodal RoPE for
    :meth:`rotate_3d`: frequencies ``0 .. t-1`` turn with a token's temporal position, the next
    ``h`` with its row, the last ``w`` with its column. Each section keeps its frequencies of the
    1D table, so a token at (p, p, p) is rotated exactly as :meth:`forward` rotates it at p.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        theta: float,
        d_k: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        llama3_scaling: tuple[float, float, float, int] | None = None,
        mrope_sections: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even head dim, got {d_k}")
        if mrope_sections and (len(mrope_sections) != 3 or sum(mrope_sections) != d_k // 2):
            raise ValueError(
                f"mrope_sections {list(mrope_sections)} must be 3 sizes summing to {d_k // 2}"
            )
        self.mrope_sections = tuple(mrope_sections)
        self.theta = theta
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        # (factor, low_freq_factor, high_freq_factor, original_context), see
        # llama3_scaled_inv_freq; None = plain RoPE.
        self.llama3_scaling = llama3_scaling
        self.register_buffer("cos", torch.empty(max_seq_len, d_k // 2, device=device), False)
        self.register_buffer("sin", torch.empty(max_seq_len, d_k // 2, device=device), False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the cos/sin tables in fp32 on the buffers' device."""
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq = self.theta ** (
            -torch.arange(0, self.d_k, 2, device=device, dtype=torch.float64) / self.d_k
        )  # (E/2,)
        if self.llama3_scaling is not None:
            inv_freq = llama3_scaled_inv_freq(inv_freq, *self.llama3_scaling)  # (E/2,)
        pos = torch.arange(self.max_seq_len, device=device, dtype=torch.float64)  # (T,)
        angles = torch.outer(pos, inv_freq)  # (T, E/2)
        # float64 for the angles keeps the large-position entries exact before rounding to fp32.
        with torch.no_grad():
            self.cos.copy_(angles.cos().to(self.cos.dtype))
            self.sin.copy_(angles.sin().to(self.sin.dtype))

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # model.to(torch.bfloat16) would round the tables to bf16; keep them fp32 and exact.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos = self.cos.float()
            self.sin = self.sin.float()
            self.reset_parameters()
        return self

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (..., T, E) at ``token_positions`` (broadcastable to (..., T)).

        The rotation runs in fp32 and the result is cast back to ``x``'s dtype.
        """
        cos = self.cos[token_positions].float()  # (..., T, E/2)
        sin = self.sin[token_positions].float()  # (..., T, E/2)
        return self._rotate(x, cos, sin)

    def rotate_3d(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """MRoPE: rotate ``x`` (..., T, E) at 3-vector positions ``token_positions`` (3, ...)
        whose last dims broadcast to (..., T): component 0 temporal, 1 row, 2 column.

        The reference: look up each component's full cos/sin rows, then take section c's
        frequencies from component c. fp32 as :meth:`forward`.
        """
        if not self.mrope_sections:
            raise ValueError("rotate_3d needs mrope_sections (this RoPE is 1D)")
        if token_positions.shape[0] != 3:
            raise ValueError(
                f"MRoPE positions must be (3, ...), got {tuple(token_positions.shape)}"
            )
        cos_parts, sin_parts, start = [], [], 0
        for c, size in enumerate(self.mrope_sections):
            idx = token_positions[c]  # (..., T): this component's position
            cos_parts.append(self.cos[idx, start : start + size])  # (..., T, size)
            sin_parts.append(self.sin[idx, start : start + size])  # (..., T, size)
            start += size
        cos = torch.cat(cos_parts, dim=-1).float()  # (..., T, E/2)
        sin = torch.cat(sin_parts, dim=-1).float()  # (..., T, E/2)
        return self._rotate(x, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` (..., T, E) rotated pairwise by angles with cos/sin (..., T, E/2), in fp32."""
        pairs = x.float().unflatten(-1, (-1, 2))  # (..., T, E/2, 2): (x[2i], x[2i+1])
        # out[2i] = x[2i]·cos − x[2i+1]·sin, out[2i+1] = x[2i+1]·cos + x[2i]·sin, written as one
        # element-wise expression over the pairs and their swap (same fp32 products and sums as
        # the two-halves form, so the same values).
        signed_sin = torch.stack((-sin, sin), dim=-1)  # (..., T, E/2, 2)
        out = pairs * cos.unsqueeze(-1) + pairs.flip(-1) * signed_sin  # (..., T, E/2, 2)
        return out.flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        mrope = f", mrope_sections={self.mrope_sections}" if self.mrope_sections else ""
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}{mrope}"


def scaled_dot_product_attention(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(Q Kᵀ / sqrt(E)) V`` over any leading dims; the reference attention.

    Q (..., T, E), K (..., S, E), V (..., S, Ev); ``mask`` is boolean, broadcastable to
    (..., T, S), True = may attend. Returns (..., T, Ev). The full T×S score matrix is
    materialised (that is what makes it the slow reference).
    """
    scale = 1.0 / math.sqrt(Q.shape[-1])
    scores = (Q @ K.transpose(-2, -1)) * scale  # (..., T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax(scores.float(), dim=-1).to(V.dtype)  # (..., T, S)
    return probs @ V  # (..., T, Ev)
