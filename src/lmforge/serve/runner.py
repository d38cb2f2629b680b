"""One engine step through the model's own forward: the step's inputs and its context.

There is no forward here: :func:`forward_step` builds the model's per-step
:class:`~lmforge.model.context.Context` (positions, slots, block tables, lengths, the kernels
of :mod:`lmforge.serve.attention`) and calls ``TransformerLM.forward``, which runs every model
switch (muP, QK-norm, soft-cap, tied head, GQA, RoPE scaling, MoE) the way training does; the
step's tokens of all sequences are one flat (1, N) batch (no padding). ``lmforge.generate``
stays the readable reference: the tests check this path's greedy tokens against it.

Shape legend: N tokens in the step, S sequences, D model dim, H heads, K kv-heads, E head dim,
V vocab, L layers, NB blocks, BS block size.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmforge.model.context import Context, PagedKVCache
from lmforge.serve.attention import PagedOps, prefill_kernel_on, prefill_plan

__all__ = ["PagedKVCache", "StepBatch", "forward_step"]


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


def forward_step(
    model: nn.Module, cache: PagedKVCache, batch: StepBatch, *, use_triton: bool | None = None
) -> torch.Tensor:
    """Run ``model``'s own forward on one step's tokens with the paged-attention kernels of
    :mod:`lmforge.serve.attention`, writing their KV; logits of each sequence's last token:
    (S, V) float32."""
    plan = None
    if not batch.decode_only:  # the prefill kernel's tiles: built once per step, not per layer
        dev, e = batch.tokens.device, cache.k.shape[-1]
        if use_triton if use_triton is not None else prefill_kernel_on(dev, e):
            plan = prefill_plan(batch.q_lens, batch.ctx_lens_list, dev, head_dim=e)
    ctx = Context(
        batch.positions, batch.slots, batch.block_tables, batch.ctx_lens, cache.k, cache.v,
        PagedOps(use_triton), last_rows=batch.last_rows, decode=batch.decode_only,
        q_lens=batch.q_lens, ctx_lens_list=batch.ctx_lens_list, tables_list=batch.tables_list,
        plan=plan,
    )  # fmt: skip
    return model(batch.tokens[None], context=ctx)[0].float()  # (1, N) -> (S, V)
