"""Packing several examples into one row without attention between them.

Each packed row holds whole examples back to back; every example restarts its RoPE positions at
0 and attends only to its own earlier tokens (a block-diagonal causal mask), so a packed batch
computes the same per-token losses and gradients as the examples one by one (tested).

How the mask reaches the model without touching ``lmforge.model``: ``TransformerLM.forward``
accepts a ``kv_cache`` object; :class:`_BlockDiagonalMask` is one that stores nothing (``begin``
hands out the per-example positions and the mask, ``update`` returns the layer's own
keys/values), so every attention backend runs its masked path. A transformers model gets
``position_ids`` and a 4-D additive mask (B, 1, T, T).

Shape legend: B batch (packed rows), T packed length, K kv-heads, E head dim.
Exercised by ``pytest tests/test_posttrain_sft.py -k packing``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from lmforge.posttrain.core import IGNORE, Batch, Example, is_lmforge_model
from lmforge.utils.errors import LmforgeError


class _BlockDiagonalMask:
    """A stand-in for ``KVCache`` whose attention mask is block-diagonal causal (see module doc)."""

    def __init__(self, positions: torch.Tensor, mask: torch.Tensor) -> None:
        self._positions = positions  # (B, T)
        self._mask = mask[:, None]  # (B, 1, T, T)
        self._keys: dict[int, torch.Tensor] = {}  # layer -> this forward's keys (CLA consumers)

    def begin(self, num_new: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if num_new != self._positions.shape[1]:
            raise ValueError("packed mask built for a different length")
        return self._positions, self._mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._keys[layer] = k  # held for this forward only: an MLA+CLA consumer reads them
        return k, v  # (B, K, T, E): nothing cached, the layer attends over its own keys

    def keys(self, layer: int) -> torch.Tensor:
        """The keys (B, K, T, E) layer ``layer``'s producer passed to :meth:`update`."""
        return self._keys[layer]

    @property
    def mask(self) -> torch.Tensor:
        return self._mask


@dataclasses.dataclass
class Packed:
    """Packing information for a batch: ``segments`` (B, T) long, 1, 2, … per example in a row
    and 0 on padding; ``positions`` (B, T) long, restarting at 0 at each example."""

    segments: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor | None = None
    "(B, T) long: which input example each position came from (-1 on padding)"

    def to(self, device: torch.device | str) -> Packed:
        index = None if self.index is None else self.index.to(device)
        return Packed(self.segments.to(device), self.positions.to(device), index)

    def bool_mask(self) -> torch.Tensor:
        """(B, T, T) bool: query i sees key j iff same example and j ≤ i (padding sees itself)."""
        seg = self.segments
        t = seg.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()  # (T, T)
        same = seg[:, :, None] == seg[:, None, :]  # (B, T, T)
        own = torch.eye(t, dtype=torch.bool, device=seg.device)[None]  # (1, T, T)
        return (same & causal[None] & (seg[:, :, None] > 0)) | own

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of the packed ``input_ids`` (B, T) with no cross-example attention."""
        mask = self.bool_mask()  # (B, T, T)
        if is_lmforge_model(model):
            cfg = model.config
            if int(self.positions.max()) >= cfg.context_length:
                raise LmforgeError(
                    f"a packed example is longer than the model's context ({cfg.context_length})"
                )
            return model(input_ids, kv_cache=_BlockDiagonalMask(self.positions, mask))
        neg = torch.finfo(torch.float32).min
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive = additive.masked_fill(~mask, neg)[:, None]  # (B, 1, T, T)
        try:
            out = model(input_ids=input_ids, position_ids=self.positions, attention_mask=additive)
        except (TypeError, ValueError, RuntimeError) as e:
            raise LmforgeError(
                f"{type(model).__name__} does not take a 4-D attention mask for packing "
                f"({str(e).splitlines()[0]}); use --sft.packing=false"
            ) from None
        return getattr(out, "logits", out)


def pack(examples: Sequence[Example], max_len: int, pad_id: int = 0) -> tuple[Batch, Packed]:
    """Greedy first-fit packing of examples (as shifted inputs/labels) into rows of ≤ ``max_len``
    (longer examples truncated), right-padded to the longest row."""
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    pairs = [ex.shifted() for ex in examples]
    pairs = [(i[:max_len], lab[:max_len], k) for k, (i, lab) in enumerate(pairs)]
    rows: list[list[tuple[list[int], list[int], int]]] = []
    fill: list[int] = []
    for pair in sorted(pairs, key=lambda p: -len(p[0])):  # longest first packs tighter
        n = len(pair[0])
        for r, used in enumerate(fill):
            if used + n <= max_len:
                rows[r].append(pair)
                fill[r] += n
                break
        else:
            rows.append([pair])
            fill.append(n)
    t = max(fill)
    b = len(rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((b, t), IGNORE, dtype=torch.long)  # (B, T)
    segments = torch.zeros(b, t, dtype=torch.long)  # (B, T)
    positions = torch.zeros(b, t, dtype=torch.long)  # (B, T)
    index = torch.full((b, t), -1, dtype=torch.long)  # (B, T)
    for r, row in enumerate(rows):
        start = 0
        for s, (inp, lab, k) in enumerate(row, start=1):
            n = len(inp)
            ids[r, start : start + n] = torch.tensor(inp)
            labels[r, start : start + n] = torch.tensor(lab)
            segments[r, start : start + n] = s
            positions[r, start : start + n] = torch.arange(n)
            index[r, start : start + n] = k
            start += n
    return Batch(ids, labels), Packed(segments, positions, index)
