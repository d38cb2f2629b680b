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

from lmforge.model.context import Context, PagedKVCache, StepOps
from lmforge.serve.attention import PagedOps, prefill_kernel_on
from lmforge.serve.attention import prefill_plan as prefill_plan_for

__all__ = ["PagedKVCache", "StepBatch", "forward_step", "step_context"]


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


def step_context(
    cache: PagedKVCache, batch: StepBatch, ops: StepOps, *, prefill_plan: bool = True
) -> Context:
    """The model's :class:`~lmforge.model.context.Context` for ``batch`` on ``cache``: host
    lists for prefill steps (and the prefill kernel's tile list, built once per step where the
    kernel runs), tensors only for decode steps."""
    plan = None
    decode = batch.decode_only
    if not decode and prefill_plan and isinstance(ops, PagedOps):
        dev, e = batch.tokens.device, cache.k.shape[-1]
        if ops.use_triton if ops.use_triton is not None else prefill_kernel_on(dev, e):
            plan = prefill_plan_for(batch.q_lens, batch.ctx_lens_list, dev, head_dim=e)
    return Context(
        positions=batch.positions, slots=batch.slots, block_tables=batch.block_tables,
        ctx_lens=batch.ctx_lens, k_cache=cache.k, v_cache=cache.v, ops=ops,
        last_rows=batch.last_rows, decode=decode, q_lens=batch.q_lens,
        ctx_lens_list=batch.ctx_lens_list, tables_list=batch.tables_list, plan=plan,
    )  # fmt: skip


def forward_step(
    model: nn.Module,
    cache: PagedKVCache,
    batch: StepBatch,
    *,
    use_triton: bool | None = None,
    ops: StepOps | None = None,
) -> torch.Tensor:
    """Run ``model``'s own forward on one step's tokens, writing their KV; logits of each
    sequence's last token: (S, V) float32. ``ops``: the kernels (default: the paged-attention
    kernels of :mod:`lmforge.serve.attention` with ``use_triton``)."""
    ops = ops if ops is not None else PagedOps(use_triton)
    ctx = step_context(cache, batch, ops)
    return model(batch.tokens[None], context=ctx)[0].float()  # (1, N) -> (S, V)
