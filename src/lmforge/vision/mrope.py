"""3-vector positions of a multimodal prompt for MRoPE (Qwen2-VL's multimodal rotary embedding).

An MRoPE model (``model.mrope_sections = [t, h, w]``) rotates the first ``t`` rotary frequencies
by a token's temporal position, the next ``h`` by its row and the last ``w`` by its column
(:meth:`lmforge.model.RotaryEmbedding.rotate_3d`). This module says which 3-vector each token
gets, Qwen2-VL's rule:

- a text token at running position p is (p, p, p): exactly 1D RoPE at p;
- the ``h·w`` tokens of an image starting at running position t0, in row-major patch order, are
  (t0, t0 + row, t0 + col): one time step, a 2D grid;
- the token after an image continues from the largest component so far plus one,
  t0 + max(h, w): so a prompt's positions stay below its length and text after an image is
  again (p, p, p), only shifted by a per-sequence constant.

Shape legend: B batch, T tokens. Exercised by ``pytest tests/test_mrope.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["engine_step_positions", "image_spans", "mrope_positions", "mrope_positions_batch"]


def mrope_positions(
    token_ids: torch.Tensor | Sequence[int],
    image_spans: Sequence[tuple[int, int]],
    grid_hw: tuple[int, int] | Sequence[tuple[int, int]],
) -> torch.Tensor:
    """(3, T) long MRoPE positions of one prompt of T tokens (ids only give T and the device).

    ``image_spans``: (start, n) of each image's slots, in order, non-overlapping; ``grid_hw``:
    the patch grid (rows, cols) of every image, or one (rows, cols) per span; n = rows·cols.
    """
    t = len(token_ids)
    device = token_ids.device if isinstance(token_ids, torch.Tensor) else None
    spans = sorted((int(s), int(n)) for s, n in image_spans)
    if isinstance(grid_hw[0], int):  # one grid for every image
        grids = [(int(grid_hw[0]), int(grid_hw[1]))] * len(spans)
    else:
        grids = [(int(h), int(w)) for h, w in grid_hw]  # type: ignore[misc]
    if len(grids) != len(spans):
        raise ValueError(f"{len(spans)} image spans but {len(grids)} grids")
    out = torch.empty(3, t, dtype=torch.long)
    next_pos, cursor = 0, 0  # running position, first token not yet placed
    for (start, n), (h, w) in zip(spans, grids, strict=True):
        if start < cursor or start + n > t or n != h * w:
            raise ValueError(
                f"image span ({start}, {n}) with grid {h}x{w} does not fit a {t}-token prompt"
                " (spans in order, inside the prompt, n = rows·cols)"
            )
        text = torch.arange(next_pos, next_pos + start - cursor)  # the text before the image
        out[:, cursor:start] = text
        t0 = next_pos + start - cursor
        rows = torch.arange(h).repeat_interleave(w)  # (n,): row-major patch order
        cols = torch.arange(w).repeat(h)  # (n,)
        out[0, start : start + n] = t0
        out[1, start : start + n] = t0 + rows
        out[2, start : start + n] = t0 + cols
        next_pos, cursor = t0 + max(h, w), start + n
    out[:, cursor:] = torch.arange(next_pos, next_pos + t - cursor)
    return out if device is None else out.to(device)


def image_spans(
    tokens: Sequence[int] | torch.Tensor, image_id: int, n: int
) -> list[tuple[int, int]]:
    """(start, n) of each image in ``tokens``: the runs of ``image_id``, each run k·n long
    holding k back-to-back images."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    spans, i = [], 0
    while i < len(ids):
        if ids[i] != image_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_id:
            j += 1
        if (j - i) % n:
            raise ValueError(f"a run of {j - i} <image> slots at {i} is not a multiple of {n}")
        spans += [(s, n) for s in range(i, j, n)]
        i = j
    return spans


def mrope_positions_batch(
    tokens: torch.Tensor, image_id: int, grid_hw: tuple[int, int]
) -> torch.Tensor:
    """(3, B, T) MRoPE positions of a batch of prompts (B, T), images found as runs of
    ``image_id`` (each image rows·cols slots); padding after a prompt continues as text."""
    n = grid_hw[0] * grid_hw[1]
    rows = [mrope_positions(row, image_spans(row, image_id, n), grid_hw) for row in tokens.cpu()]
    return torch.stack(rows, dim=1).to(tokens.device)  # (3, B, T)


def engine_step_positions(
    rows: Sequence[tuple[Sequence[tuple[int, int]] | None, int, int]],
) -> tuple[list[int], list[list[int]] | None]:
    """An engine step's MRoPE positions: per sequence, in row order, (its image spans or None,
    first position in the step, tokens in the step); spans are square grids (lmforge's towers
    give one square patch grid per image).

    Returns the scalar positions (N,) and, when the step holds image rows, the 3-vectors
    (3, N). Text rows are (p, p, p), so a scalar suffices wherever no image row is in the step
    (decode included: p is the 1D index shifted by the images before it, Qwen2-VL's rule).
    """
    flat: list[list[int]] = [[], [], []]
    has_image = False
    for spans, start, n in rows:
        if not spans:  # a text-only sequence: its 1D positions
            for comp in flat:
                comp.extend(range(start, start + n))
            continue
        grids = []
        for _, size in spans:
            g = math.isqrt(size)
            if g * g != size:
                raise ValueError(f"an image of {size} slots is not a square patch grid")
            grids.append((g, g))
        # a prefill chunk may end inside an image: place the whole prompt's images, then slice
        length = max(start + n, *(lo + size for lo, size in spans))
        pos = mrope_positions(range(length), spans, grids)[:, start : start + n]  # (3, n)
        has_image |= any(lo < start + n and lo + size > start for lo, size in spans)
        for c in range(3):
            flat[c].extend(pos[c].tolist())
    return flat[0], (flat if has_image else None)
