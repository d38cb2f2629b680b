"""The decode step through ``torch.compile``: inductor fuses the model's elementwise chains.

The engine's eager decode step runs the model's reference modules, so every RMSNorm, RoPE and
SwiGLU is a chain of small elementwise kernels (~50 per layer); at batch 1 a step is launch
bound even inside a CUDA graph. Here the same step (the model's own modules, so any checkpoint
runs unchanged) is traced by dynamo and compiled by inductor, which fuses those chains into a
few Triton kernels per layer around the GEMMs. The paged KV write + attention is one opaque
custom op (``lmforge_serve::decode_attention``, mutating the caches): dynamo does not trace
into the Triton kernel or the torch reference, and inductor writes the pages in place (no
functional copy of the cache). Shapes are dynamic (one compile serves every batch bucket; batch
1 gets its own specialisation), and :class:`~lmforge.serve.cuda_graphs.DecodeGraphs` captures
the compiled step per bucket like the eager one.

Fallback: if compiling or running the compiled step fails, one line on stderr says so and the
engine decodes eagerly from then on.

Shape legend: N tokens (= S sequences in decode), D model dim, H heads, K kv-heads, E head dim,
V vocab, L layers, NB blocks, BS block size, M table width.
Exercised by ``pytest tests/test_serve_compiled.py``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmforge.serve.attention import paged_decode, write_kv
from lmforge.serve.runner import StepBatch, forward_step

if TYPE_CHECKING:
    from lmforge.serve.runner import PagedKVCache

__all__ = ["CompiledDecode", "decode_forward"]


@torch.library.custom_op("lmforge_serve::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    use_triton: int,
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V (S, K, E) at ``slots`` of the (L, NB, BS, K, E) caches,
    then decode attention for q (S, H, E) -> (S, H, E). ``use_triton``: -1 auto, 0 no, 1 yes."""
    kc, vc = k_cache[layer], v_cache[layer]
    write_kv(kc, vc, slots, k, v)
    flag = None if use_triton < 0 else bool(use_triton)
    return paged_decode(q, kc, vc, block_tables, ctx_lens, use_triton=flag).contiguous()


@_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer, slots, block_tables, ctx_lens, use_triton):
    return torch.empty_like(q)


def decode_forward(
    model: nn.Module,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    use_triton: int,
) -> torch.Tensor:
    """One decode step (one token per sequence, so row i is sequence i's last token), the same
    math as :func:`~lmforge.serve.runner.forward_step`: logits (S, V) float32."""
    x = model.residual_stream(model.token_embeddings(tokens))  # (S, D)
    n = x.shape[0]
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        h = layer.ln1(x)
        nh, kvh, e = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = attn.q_proj(h).view(n, nh, e)  # (S, H, E)
        k = attn.k_proj(h).view(n, kvh, e)  # (S, K, E)
        v = attn.v_proj(h).view(n, kvh, e)  # (S, K, E)
        if attn.config.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.rope(q.transpose(0, 1), positions).transpose(0, 1)  # (S, H, E)
        k = attn.rope(k.transpose(0, 1), positions).transpose(0, 1)  # (S, K, E)
        o = torch.ops.lmforge_serve.decode_attention(
            q, k, v, k_cache, v_cache, i, slots, block_tables, ctx_lens, use_triton
        )  # (S, H, E)
        x = x + attn.output_proj(o.reshape(n, nh * e))
        x = x + layer.ffn(layer.ln2(x))  # (S, D)
    return model.logits_from_hidden(model.ln_final(x)).float()  # (S, V)


class CompiledDecode:
    """``batch -> logits`` for decode-only steps: compiled :func:`decode_forward`, or the eager
    :func:`~lmforge.serve.runner.forward_step` once compiling has failed."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, use_triton: bool | None) -> None:
        self.model = model
        self.cache = cache
        self.use_triton = use_triton
        self._flag = -1 if use_triton is None else int(use_triton)
        self.failed: str | None = None
        self._fn = torch.compile(decode_forward, dynamic=True)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        if self.failed is None:
            try:
                return self._fn(
                    self.model,
                    self.cache.k,
                    self.cache.v,
                    batch.tokens,
                    batch.positions,
                    batch.slots,
                    batch.block_tables,
                    batch.ctx_lens,
                    self._flag,
                )
            except Exception as e:  # any compile/run failure: eager from now on, said once
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(
                    f"lmforge serve: torch.compile of the decode step failed, decoding eagerly "
                    f"({self.failed[:300]})",
                    file=sys.stderr,
                )
        return forward_step(self.model, self.cache, batch, use_triton=self.use_triton)
