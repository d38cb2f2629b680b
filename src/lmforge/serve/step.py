"""One engine step's inputs on the device and the call of the model's own forward on them.

:class:`StepBatch` is what the :class:`~lmforge.serve.model_runner.ModelRunner` runs (built by
:func:`stage` from the scheduler's host lists); :func:`forward_step` is the eager step that the
compiled decode step (:mod:`lmforge.serve.compiled`) and CUDA-graph capture
(:mod:`lmforge.serve.cuda_graphs`) wrap. Its own module so that those two and the runner that
chooses between them import it without importing each other.

Shape legend: N tokens in the step, S sequences, V vocab, M block-table width, D model dim.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable

import torch
from torch import nn

from lmforge.model.context import Context, PagedKVCache
from lmforge.model.linear_attention import StatePool, StepStates
from lmforge.model.mla import PagedLatentCache
from lmforge.serve.attention import PagedOps, prefill_kernel_on, prefill_plan
from lmforge.serve.scheduler import StepInputs

__all__ = ["StepBatch", "forward_step", "stage"]


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
    image_rows: torch.Tensor | None = None
    "(I,) long rows whose input is an image embedding (a VLM prompt's slots), or None"
    image_embeds: torch.Tensor | None = None
    "(I, D) those rows' embeddings"
    state_slots: torch.Tensor | None = None
    "(S,) long recurrent-state slot of each sequence (hybrid models with G/M/L layers), or None"
    state_fresh: torch.Tensor | None = None
    "(F,) long slots to zero before the forward (sequences starting at token 0), or None"
    mrope_positions: torch.Tensor | None = None
    "(3, N) long 3-vector positions of an MRoPE model's step with image rows, or None"

    @property
    def decode_only(self) -> bool:
        """Whether every sequence feeds exactly one token (the decode kernel's case)."""
        return all(t == 1 for t in self.q_lens)


def as_decode_rows(batch: StepBatch) -> StepBatch:
    """One sequence's n-token step (a speculative verify: its last token and the drafts) as n
    one-token decode rows over the same block table, row i's context ending at its own token:
    the decode kernels write every row's keys/values before any row attends (separate
    launches), so row i sees rows 0..i as the n-token step would, and the step can take the
    compiled decode step and CUDA graphs. Attention-only models (a linear layer's state is
    sequential). Logits come back for every row."""
    n = batch.q_lens[0]
    end = batch.ctx_lens_list[0]
    ctx = [end - n + 1 + i for i in range(n)]
    # from the staged (1,) ctx_lens on the device: a tensor built from the host list would be
    # a copy from pageable memory, which waits for the queued work (a sync) on CUDA
    steps = torch.arange(1 - n, 1, dtype=torch.int32, device=batch.ctx_lens.device)
    return dataclasses.replace(
        batch,
        block_tables=batch.block_tables.expand(n, -1).contiguous(),  # (n, M)
        ctx_lens=batch.ctx_lens[:1] + steps,  # (n,) int32
        last_rows=torch.arange(n, device=batch.last_rows.device),
        q_lens=[1] * n,
        ctx_lens_list=ctx,
        tables_list=batch.tables_list * n,
    )


def forward_step(
    model: nn.Module,
    cache: PagedKVCache | PagedLatentCache,
    batch: StepBatch,
    *,
    use_triton: bool | None = None,
    states: StatePool | None = None,
) -> torch.Tensor:
    """Run ``model``'s own forward on one step's tokens with the paged-attention kernels of
    :mod:`lmforge.serve.attention`, writing their KV; logits of each sequence's last token:
    (S, V) float32. An MLA model's cache is a :class:`PagedLatentCache` (the context's
    ``latent_cache``; its attention reads no K/V pages and no prefill plan). A hybrid model's
    linear layers read and write ``states`` (the runner's :class:`StatePool`) at the batch's
    ``state_slots``; the slots of sequences starting at token 0 are zeroed first."""
    plan = None
    latent = cache.latent if isinstance(cache, PagedLatentCache) else None
    if latent is not None:
        k_cache = v_cache = latent.new_empty(0)
    else:
        k_cache, v_cache = cache.k, cache.v
        if not batch.decode_only:  # the prefill kernel's tiles: built once per step
            dev, e = batch.tokens.device, cache.head_dim
            if use_triton if use_triton is not None else prefill_kernel_on(dev, e):
                plan = prefill_plan(batch.q_lens, batch.ctx_lens_list, dev, head_dim=e)
    positions = batch.positions  # (N,), or an MRoPE image step's (3, 1, N):
    if batch.mrope_positions is not None:
        positions = batch.mrope_positions[:, None]  # (3, 1, N) as TransformerLM reads them
    ctx = Context(
        positions, batch.slots, batch.block_tables, batch.ctx_lens, k_cache, v_cache,
        PagedOps(use_triton), last_rows=batch.last_rows, decode=batch.decode_only,
        q_lens=batch.q_lens, ctx_lens_list=batch.ctx_lens_list, tables_list=batch.tables_list,
        plan=plan, latent_cache=latent,
    )  # fmt: skip
    if latent is None and cache.index_k.numel():  # DSA (S layers): their indexer-key pages
        ctx.index_cache = cache.index_k
    if states is not None:
        if batch.state_slots is None:
            raise ValueError("a model with recurrent layers needs the step's state slots")
        if batch.state_fresh is not None:
            states.reset(batch.state_fresh)
        ctx.states = StepStates(states, batch.state_slots)
        if states.ring_k is not None:  # W layers beside A/S layers: their per-sequence rings
            ctx.ring = states.ring_context(ctx, batch.state_slots)
    embeds = None
    if batch.image_rows is not None:  # a VLM's image slots: the one forward's input_embeds
        embeds = model.token_embeddings(batch.tokens[None])  # (1, N, D)
        embeds[0, batch.image_rows] = batch.image_embeds.to(embeds.dtype)
    return model(batch.tokens[None], context=ctx, input_embeds=embeds)[0].float()  # (S, V)


def stage(
    inputs: StepInputs,
    device: torch.device,
    copy: Callable[[array, array], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> StepBatch:
    """A step's host lists as a :class:`StepBatch` on ``device``: two tensors (int64: tokens,
    positions, slots, rows; int32: context lengths, tables), one copy each (by ``copy``, e.g.
    the runner's pinned staging); the fields are views of them. Both are built as C arrays:
    the block tables (the scheduler's ``array('i')``) go in by memory copies, so 64 tables
    of 1,000 blocks cost microseconds, not the ~6 ms of converting 64,000 Python ints."""
    tables = inputs.tables
    width = max(len(t) for t in tables)
    n_tok, n_seq = len(inputs.tokens), len(tables)
    longs = array("q", inputs.tokens)
    for part in (inputs.positions, inputs.slots, inputs.last_rows):
        longs.extend(part)
    ints = array("i", inputs.ctx_lens)
    pad = array("i", bytes(4 * width))  # zeros
    for t in tables:
        ints.extend(t)  # an array('i'): a memory copy
        if len(t) < width:
            ints.extend(pad[: width - len(t)])
    if copy is None:
        dev64 = torch.frombuffer(longs, dtype=torch.long).to(device)
        dev32 = torch.frombuffer(ints, dtype=torch.int32).to(device)
    else:
        dev64, dev32 = copy(longs, ints)
    batch = StepBatch(
        tokens=dev64[:n_tok],
        positions=dev64[n_tok : 2 * n_tok],
        slots=dev64[2 * n_tok : 3 * n_tok],
        block_tables=dev32[n_seq:].view(n_seq, width),
        ctx_lens=dev32[:n_seq],
        last_rows=dev64[3 * n_tok :],
        q_lens=inputs.q_lens,
        ctx_lens_list=inputs.ctx_lens,
        tables_list=[t[:] for t in tables],  # snapshots: the scheduler appends later
    )
    if inputs.state_slots:  # a hybrid model's recurrent-state slots (few ints: not staged above)
        batch.state_slots = torch.tensor(inputs.state_slots, device=device)
        if inputs.state_fresh:
            batch.state_fresh = torch.tensor(inputs.state_fresh, device=device)
    if inputs.image_rows:  # a VLM prompt's image slots in this step (rare: not staged above)
        batch.image_rows = torch.tensor(inputs.image_rows, device=device)
        parts = [e[lo:hi] for e, lo, hi in inputs.image_parts]
        batch.image_embeds = torch.cat(parts).to(device)  # (I, D)
    return batch
