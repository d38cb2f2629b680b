"""An IsoFLOP sweep's grid: compute budgets × a model family → (N, D, steps) per point.

The family has one dial, the depth L (nanochat's rule): ``d_model = aspect · L`` rounded to a
multiple of ``head_dim``, ``n_heads = d_model / head_dim``; everything else comes from the base
run config. N is N_matmul (:func:`lmforge.model.accounting.matmul_parameters`: the weights that
take part in matmuls, LM head included, embedding lookup and norm gains not) so that 6·N·D is
the familiar FLOP approximation. D per point comes from the budget by the chosen FLOP rule:

- ``6nd``: D = C / (6·N);
- ``exact``: D = C / flops_per_token(cfg, T), the per-layer count of
  :mod:`lmforge.model.accounting` (attention's T-dependent term included).

D is then rounded to whole optimizer steps; each point records the FLOPs it will really spend
(by the chosen rule) next to the budget it belongs to. Exercised by
``pytest tests/test_scaling_sweep.py``; the command is ``lmforge scaling plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from lmforge.utils.errors import LmforgeError

FlopRule = Literal["6nd", "exact"]


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One training run of a sweep."""

    id: str
    "stable name: budget and depth (the sweep folder's point directory and the resume key)"
    budget: float
    "the compute budget this point belongs to"
    n_layers: int
    "depth L"
    d_model: int
    "width"
    n_heads: int
    "query heads"
    parameters: int
    "N = N_matmul"
    parameters_total: int
    "every parameter (embedding included)"
    steps: int
    "optimizer steps"
    tokens: int
    "D = steps · tokens per step"
    flops: float
    "the FLOPs the run spends, by the plan's rule"
    flops_rule: str
    "6nd or exact"

    def overrides(self) -> dict[str, Any]:
        """The dotted config keys this point sets on the base run config."""
        return {
            "model.n_layers": self.n_layers,
            "model.d_model": self.d_model,
            "model.n_heads": self.n_heads,
            "train.max_steps": self.steps,
        }


def family_shape(depth: int, aspect: int, head_dim: int) -> tuple[int, int]:
    """(d_model, n_heads) of depth ``depth``: d_model = aspect·L rounded up to a multiple of E."""
    if depth <= 0 or aspect <= 0 or head_dim <= 0 or head_dim % 2:
        raise LmforgeError(
            f"family needs positive depth, aspect and an even head_dim, got depth={depth} "
            f"aspect={aspect} head_dim={head_dim}"
        )
    d = -(-aspect * depth // head_dim) * head_dim
    return d, d // head_dim


def plan_grid(
    base: Any,
    budgets: Sequence[float],
    depths: Sequence[int],
    aspect: int = 64,
    head_dim: int = 64,
    flops_rule: FlopRule = "6nd",
    min_steps: int = 10,
) -> list[GridPoint]:
    """The (N, D) grid of a sweep over ``budgets`` × ``depths`` on the base ``RunConfig``.

    Points that would train for fewer than ``min_steps`` steps are left out (too few tokens for a
    meaningful loss). Pure: builds no model.
    """
    from lmforge.model import accounting
    from lmforge.train.plan import training_plan

    if flops_rule not in ("6nd", "exact"):
        raise LmforgeError(f"flops rule must be 6nd or exact, got {flops_rule!r}")
    if not budgets or not depths:
        raise LmforgeError("a sweep needs at least one budget and one depth")
    points: list[GridPoint] = []
    for c in sorted(budgets):
        if c <= 0:
            raise LmforgeError(f"budgets must be positive, got {c}")
        for depth in sorted(depths):
            d_model, heads = family_shape(depth, aspect, head_dim)
            try:
                mcfg = dataclasses.replace(
                    base.model,
                    n_layers=depth,
                    d_model=d_model,
                    n_heads=heads,
                    n_kv_heads=None,
                    d_ff=None,
                )
            except ValueError as e:
                raise LmforgeError(f"depth {depth}: {e}") from None
            plan = training_plan(mcfg, dataclasses.replace(base.train, max_steps=1))
            n = accounting.matmul_parameters(mcfg)
            per_token = 6.0 * n if flops_rule == "6nd" else plan.flops_per_token
            steps = round(c / per_token / plan.tokens_per_step)
            if steps < min_steps:
                continue
            tokens = steps * plan.tokens_per_step
            points.append(
                GridPoint(
                    id=f"C{c:.3g}_L{depth}",
                    budget=float(c),
                    n_layers=depth,
                    d_model=d_model,
                    n_heads=heads,
                    parameters=int(n),
                    parameters_total=int(accounting.parameter_count(mcfg)),
                    steps=int(steps),
                    tokens=int(tokens),
                    flops=float(per_token * tokens),
                    flops_rule=flops_rule,
                )
            )
    if not points:
        raise LmforgeError(
            f"no point of the grid reaches {min_steps} steps: raise the budgets or lower the "
            "batch size / context length"
        )
    return points
