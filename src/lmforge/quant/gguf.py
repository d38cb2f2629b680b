"""GGUF files served quantized: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks become lmforge's formats.

The three llama.cpp block formats are lmforge formats at group size 32 with the same bytes:

- ``Q8_0`` (fp16 d, 32 int8 q; w = d·q) → :class:`~lmforge.quant.Int8Linear`, group 32;
- ``Q4_0`` (fp16 d, 16 bytes of nibbles; w = d·(q − 8)) → symmetric :class:`~lmforge.quant.Int4Linear`;
- ``Q4_1`` (fp16 d, fp16 m, 16 bytes; w = d·q + m) → asymmetric Int4Linear with offsets m.

A block's nibble order (low nibbles = weights 0..15, high = 16..31) is Int4Linear's per-group
half-split layout, so the codes are copied without repacking and nothing is ever dequantized to
float: the model holds about the file's bytes (plus fp32 norms and the RoPE tables).

K-quants (super-blocks of 256 weights) map to the same formats at a smaller group; their codes
are moved between nibble layouts as integers, and each sub-block's two-level scale becomes one
fp16 group parameter (the one rounding: relative 2⁻¹¹ of a scale):

- ``Q4_K`` (fp16 d, dmin; 8 sub-blocks of 32 with 6-bit scale sc and min m; w = d·sc·q − dmin·m)
  → asymmetric Int4Linear, group 32, scale d·sc, offset −dmin·m;
- ``Q6_K`` (16 sub-blocks of 16 with int8 scale sc, fp16 d; 6-bit q; w = d·sc·(q − 32))
  → Int8Linear, group 16, codes q − 32, scale d·sc (9 bits a weight: 1.37× the file's 6.56).

``Q5_K`` and the other types have no lmforge format of their bit width: one line naming the
type. A quantized token embedding becomes a :class:`~lmforge.quant.formats.QuantEmbedding` (rows
dequantized on lookup), shared with the LM head when the file ties them. Float tensors
(F32/F16/BF16) load as fp32. Exercised by ``pytest tests/test_quant_gguf.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmforge.quant.formats import (
    Int4Linear,
    Int8Linear,
    QuantEmbedding,
    QuantLinear,
    pack_int4,
)
from lmforge.utils.errors import LmforgeError

__all__ = ["gguf_linear", "import_gguf_quantized", "load_gguf_quantized"]

_QUANT = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights
_K_QUANT = {"Q4_K": 144, "Q6_K": 210}  # bytes per super-block of 256 weights
_SERVED = "Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"
_FLOAT = ("F32", "F16", "BF16")


def gguf_linear(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantLinear:
    """The module holding one quantized GGUF matrix (N, K) as stored (no float copy)."""
    n, k = shape
    if type_name in _K_QUANT:
        return _k_quant_linear(data, type_name, n, k)
    size = _QUANT.get(type_name)
    if size is None:
        raise LmforgeError(f"GGUF tensor type {type_name} cannot be served quantized ({_SERVED})")
    if k % 32:
        raise LmforgeError(f"GGUF {type_name} matrix of width {k} is not whole blocks of 32")
    # one copy of the stored bytes out of the read-only memory map (torch wants writable arrays)
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(n, k // 32, size))
    d = raw[:, :, 0:2].contiguous().view(torch.float16)[..., 0]  # (N, K/32)
    if type_name == "Q8_0":
        m = Int8Linear(k, n, 32)
        m.qweight = raw[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)  # (N, K)
        m.scales = d.clone()
        return m
    if type_name == "Q4_0":
        m4 = Int4Linear(k, n, 32, symmetric=True)
        m4.qweight = raw[:, :, 2:].reshape(n, k // 2).clone()  # (N, K/2): the same nibbles
        m4.scales = d.clone()
        return m4
    m4 = Int4Linear(k, n, 32, symmetric=False)
    m4.offsets = raw[:, :, 2:4].contiguous().view(torch.float16)[..., 0].clone()  # (N, K/32)
    m4.qweight = raw[:, :, 4:].reshape(n, k // 2).clone()  # (N, K/2)
    m4.scales = d.clone()
    return m4


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes (..., 12) -> 6-bit sub-block scales and mins, each (..., 8) int32.

    Bytes 0–3 hold scales 0–3 in their low 6 bits, bytes 4–7 mins 0–3; scales and mins 4–7 keep
    their low 4 bits in bytes 8–11 (scale low nibble, min high nibble) and their top 2 bits in
    the top 2 bits of bytes 0–3 (scales) and 4–7 (mins).
    """
    b = packed.to(torch.int32)
    lo_s, lo_m, rest = b[..., 0:4], b[..., 4:8], b[..., 8:12]  # (..., 4) each
    sc = torch.cat([lo_s & 0x3F, (rest & 0x0F) | ((lo_s >> 6) << 4)], dim=-1)  # (..., 8)
    mn = torch.cat([lo_m & 0x3F, (rest >> 4) | ((lo_m >> 6) << 4)], dim=-1)  # (..., 8)
    return sc, mn


def _k_quant_linear(data: np.ndarray, type_name: str, n: int, k: int) -> QuantLinear:
    """A Q4_K / Q6_K matrix (N, K) as Int4Linear (group 32) / Int8Linear (group 16)."""
    if k % 256:
        raise LmforgeError(f"GGUF {type_name} matrix of width {k} is not whole blocks of 256")
    size = _K_QUANT[type_name]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(n, k // 256, size))
    if type_name == "Q4_K":
        d = raw[..., 0:2].contiguous().view(torch.float16).float()  # (N, K/256, 1)
        dmin = raw[..., 2:4].contiguous().view(torch.float16).float()  # (N, K/256, 1)
        sc, mn = _k_scales_mins(raw[..., 4:16])  # (N, K/256, 8)
        # 4 chunks of 32 bytes: low nibbles = sub-block 2c, high nibbles = sub-block 2c + 1
        qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)  # (N, K/256, 4, 1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)  # (N, K) 0..15
        m4 = Int4Linear(k, n, 32, symmetric=False)
        m4.qweight = pack_int4(codes, 32)  # (N, K/2): lmforge's half-split nibble layout
        m4.scales = (d * sc).reshape(n, k // 32).half()  # (N, K/32)
        m4.offsets = (-(dmin * mn)).reshape(n, k // 32).half()  # (N, K/32)
        return m4
    # Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
    ql = raw[..., 0:128].reshape(n, k // 256, 2, 1, 64)  # (N, K/256, 2 halves, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, k // 256, 256)  # half, plane, byte
    qh = raw[..., 128:192].reshape(n, k // 256, 2, 1, 32)  # (N, K/256, 2 halves, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    high = ((qh >> shifts) & 0x03).reshape(n, k // 256, 256)  # half, 2-bit plane, byte
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)  # (N, K/256, 256) −32..31
    sc = raw[..., 192:208].contiguous().view(torch.int8).float()  # (N, K/256, 16)
    d = raw[..., 208:210].contiguous().view(torch.float16).float()  # (N, K/256, 1)
    m8 = Int8Linear(k, n, 16)
    m8.qweight = q.reshape(n, k)  # (N, K)
    m8.scales = (d * sc).reshape(n, k // 16).half()  # (N, K/16)
    return m8


def _permuted(m: QuantLinear, rows: torch.Tensor) -> QuantLinear:
    # output rows are independent: reorder every per-row buffer
    for name, buf in list(m._buffers.items()):
        if buf is not None and buf.dim() == 2:
            m._buffers[name] = buf[rows].contiguous()
    return m


def import_gguf_quantized(
    path: str | os.PathLike, *, context_length: int | None = None, device: str = "cpu"
) -> tuple[nn.Module, Any]:
    """``(TransformerLM with quantized linears, tokenizer or None)`` from a GGUF file; the chat
    template is in the tokenizer folder's ``tokenizer_config.json``."""
    model, tokenizer, _ = load_gguf_quantized(path, context_length=context_length, device=device)
    return model, tokenizer


def load_gguf_quantized(
    path: str | os.PathLike, *, context_length: int | None = None, device: str = "cpu"
) -> tuple[nn.Module, Any, str | None]:
    """``(model, tokenizer or None, chat template or None)``: :func:`lmforge.hf.gguf.import_gguf`'s
    contract with the matrices kept quantized (what ``lmforge serve --gguf`` needs to hold about
    the file's bytes)."""
    from lmforge.hf.gguf import dequantize, read_gguf, write_tokenizer_folder
    from lmforge.hf.tokenizer import load_hf_tokenizer
    from lmforge.model import RotaryEmbedding, TransformerLM

    meta, tensors = read_gguf(path, context_length)
    cfg = meta.config
    model = TransformerLM(cfg, device="meta")
    state: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantLinear] = {}
    for t in tensors:
        if t.type_name in _FLOAT or len(t.shape) == 1:
            w = torch.from_numpy(dequantize(t.data, t.type_name, t.shape).copy())
            if t.row_perm is not None:
                w = w[t.row_perm].contiguous()
            state[t.name] = w
            continue
        m = gguf_linear(t.data, t.type_name, t.shape)  # type: ignore[arg-type]
        if t.row_perm is not None:
            m = _permuted(m, t.row_perm)
        quant[t.name.removesuffix(".weight")] = m
    emb = quant.pop("token_embeddings", None)
    if emb is not None:
        model.token_embeddings = QuantEmbedding(emb)
        if cfg.tie_embeddings:
            model.lm_head = emb  # the one quantized matrix, read by the lookup and the head
    elif cfg.tie_embeddings:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    for name, m in quant.items():  # not replace_linears: it would move them to the meta device
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, m)
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise LmforgeError(f"{path}: {' '.join(str(e).split())[:300]}") from None
    if emb is None and cfg.tie_embeddings:
        model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # non-persistent tables: build them for real
            module.cos = torch.empty_like(module.cos, device="cpu")
            module.sin = torch.empty_like(module.sin, device="cpu")
            module.reset_parameters()
        elif isinstance(module, QuantEmbedding):
            module._probe = torch.zeros(0)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise LmforgeError(f"{path}: no tensor for {left[0]!r}")
    model.to(device).eval()
    tokenizer = None
    if meta.tokenizer_json is not None:
        folder = Path(tempfile.mkdtemp(prefix="lmforge-gguf-tok-"))
        write_tokenizer_folder(meta, folder)
        tokenizer = load_hf_tokenizer(folder)
    return model, tokenizer, meta.chat_template
