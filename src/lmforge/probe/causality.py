"""The causality probe: does any position's output depend on what it must not see?

A causal LM's output at position s of row b may depend only on tokens ``ids[b, :s+1]``. Three
checks, each comparing two forwards of the same model (eval mode, no gradient):

- ``future``: the tokens after position t are replaced in every row; every position ≤ t must
  be unchanged.
- ``other_rows``: every row but row 0 is replaced; row 0 must be unchanged at every position
  (a batch is not allowed to talk across its rows).
- ``incremental``: the full-sequence forward against token-by-token decoding with the KV cache
  (what inference runs); every position must agree within ``atol``.

For each check and each block the report gives how many compared positions changed (block
output beyond ``atol`` relative to that tensor's scale), the largest change and where, and for
MoE blocks how many positions' expert assignments (the set of experts a token was computed by,
dropped choices excluded) changed. Expert-choice routing and capacity dropping fail ``future``
and ``other_rows`` (which tokens an expert takes depends on the whole batch) and, because the
batch at decode time is one token per row, ``incremental``; dense models, dropless token-choice
routing and the auxiliary-loss-free bias (fixed within a forward) pass all three.

Simplification: one random batch per check, so a leak that only some inputs trigger can be
missed (use ``--batch`` / ``--seq-len`` / ``--seed``); the perturbation checks run the same shapes twice
and count changes above ``atol / 100``, the incremental one above ``atol``.
Exercised by ``pytest tests/test_probe_causality.py`` and ``lmforge probe causality``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

CHECKS = ("future", "other_rows", "incremental")


@dataclasses.dataclass
class LayerChange:
    """What changed in one layer (``L{i}`` block output, or ``logits``) for one check."""

    check: str
    "future | other_rows | incremental"
    layer: str
    "L0, L1, … (block outputs) or logits"
    compared: int
    "positions compared (row, position pairs)"
    changed: int
    "positions whose output changed beyond the tolerance"
    max_change: float
    "largest |difference| over the compared positions, relative to the reference's max |value|"
    where: tuple[int, int] | None
    "(row, position) of the largest change, when any changed"
    assignments_changed: int | None
    "positions whose set of experts changed (None for a dense layer or logits)"
    positions: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    "every (row, position) whose output or expert set changed, in row-major order"

    @property
    def broken(self) -> bool:
        """Whether this layer leaked in this check."""
        return self.changed > 0 or bool(self.assignments_changed)


@dataclasses.dataclass
class CausalityReport:
    """Every (check, layer) comparison; ``causal`` when none leaked."""

    changes: list[LayerChange]
    batch: int
    seq_len: int
    position: int
    "t: the future check perturbs positions > t and compares positions ≤ t"
    routing: str
    "the model's MoE routing, or 'dense'"

    @property
    def causal(self) -> bool:
        """True when no check found any changed position or assignment."""
        return not any(c.broken for c in self.changes)

    def first_leaks(self) -> dict[str, LayerChange]:
        """Per check, the first layer (in forward order) that leaked."""
        out: dict[str, LayerChange] = {}
        for c in self.changes:
            if c.broken and c.check not in out:
                out[c.check] = c
        return out

    def table(self) -> str:
        """A markdown table: one row per check and layer."""
        lines = [
            "| check | layer | changed positions | max change (rel.) | where (row, pos) "
            "| expert assignments changed |",
            "|---|---|---|---|---|---|",
        ]
        for c in self.changes:
            where = "" if c.where is None or not c.changed else f"{c.where}"
            assign = "" if c.assignments_changed is None else str(c.assignments_changed)
            lines.append(
                f"| {c.check} | {c.layer} | {c.changed}/{c.compared} | {c.max_change:.2e} "
                f"| {where} | {assign} |"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "causal": self.causal,
            "routing": self.routing,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "position": self.position,
            "changes": [dataclasses.asdict(c) for c in self.changes],
        }


class _Capture:
    """Block outputs (hooks) and MoE assignment masks of one forward."""

    def __init__(self, model: nn.Module) -> None:
        from lmforge.model.moe import MoEFFN

        self.model = model
        self.blocks: dict[int, torch.Tensor] = {}
        self.moe = {
            i: block.ffn
            for i, block in enumerate(model.layers)
            if isinstance(getattr(block, "ffn", None), MoEFFN)
        }
        self.handles = [
            block.register_forward_hook(self._hook(i)) for i, block in enumerate(model.layers)
        ]
        for layer in self.moe.values():
            layer.record_routing = True

    def _hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if isinstance(out, tuple):  # a cross-layer KV sharing block: (x, its K/V)
                out = out[0]
            self.blocks[i] = out.detach().float()

        return hook

    def assignments(self, i: int, shape: tuple[int, int]) -> torch.Tensor:
        """(B, T, N) bool: experts that computed each token in MoE block i's last forward."""
        layer = self.moe[i]
        r = layer.last_routing
        assert r is not None
        b, t = shape
        mask = torch.zeros(b * t, layer.n_experts, dtype=torch.bool, device=r.token_idx.device)
        kept = r.kept & (r.weight != 0)
        mask[r.token_idx[kept], r.expert_idx[kept]] = True
        return mask.view(b, t, -1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for layer in self.moe.values():
            layer.record_routing = False
            layer.last_routing = None


def _full(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    cap = _Capture(model)
    try:
        logits = model(ids).float()  # (B, T, V)
        out = {f"L{i}": cap.blocks[i] for i in sorted(cap.blocks)}
        out["logits"] = logits
        for i in cap.moe:
            out[f"assign{i}"] = cap.assignments(i, tuple(ids.shape))
        return out
    finally:
        cap.close()


def _incremental(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    from lmforge.model import KVCache

    b, t = ids.shape
    cache = KVCache.for_model(model, b, t)
    cap = _Capture(model)
    steps: dict[str, list[torch.Tensor]] = {}
    try:
        for s in range(t):
            logits = model(ids[:, s : s + 1], kv_cache=cache).float()  # (B, 1, V)
            steps.setdefault("logits", []).append(logits)
            for i in sorted(cap.blocks):
                steps.setdefault(f"L{i}", []).append(cap.blocks[i])
            for i in cap.moe:
                steps.setdefault(f"assign{i}", []).append(cap.assignments(i, (b, 1)))
    finally:
        cap.close()
    return {k: torch.cat(v, dim=1) for k, v in steps.items()}


def _compare(
    check: str,
    ref: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    rows: slice,
    cols: slice,
    atol: float,
    n_layers: int,
) -> list[LayerChange]:
    out = []
    for name in [f"L{i}" for i in range(n_layers)] + ["logits"]:
        a, b = ref[name][rows, cols], new[name][rows, cols]  # (B', T', D|V)
        scale = a.abs().max().clamp_min(1e-12)
        diff = (a - b).abs().amax(-1) / scale  # (B', T')
        moved_any = diff > atol  # (B', T')
        changed = int(moved_any.sum())
        flat = int(diff.argmax())
        where = (
            flat // diff.shape[1] + (rows.start or 0),
            flat % diff.shape[1] + (cols.start or 0),
        )
        assign = None
        key = f"assign{name[1:]}" if name != "logits" else ""
        if key in ref:
            moved = (ref[key][rows, cols] != new[key][rows, cols]).any(-1)  # (B', T')
            assign = int(moved.sum())
            moved_any = moved_any | moved
        r0, c0 = rows.start or 0, cols.start or 0
        positions = [(int(i) + r0, int(j) + c0) for i, j in moved_any.nonzero().tolist()]
        out.append(
            LayerChange(
                check, name, diff.numel(), changed, float(diff.max()), where, assign, positions
            )
        )
    return out


def _replace_tokens(
    ids: torch.Tensor, mask: torch.Tensor, vocab: int, gen: torch.Generator
) -> torch.Tensor:
    """``ids`` with every masked token replaced by a different random one."""
    shift = torch.randint(1, vocab, ids.shape, generator=gen)
    return torch.where(mask, (ids + shift.to(ids.device)) % vocab, ids)


@torch.no_grad()
def probe_causality(
    model: nn.Module,
    *,
    batch: int = 4,
    seq_len: int = 32,
    position: int | None = None,
    seed: int = 0,
    atol: float = 1e-4,
    checks: tuple[str, ...] = CHECKS,
) -> CausalityReport:
    """Run the causality checks (:data:`CHECKS`) on ``model`` (a TransformerLM) and report.

    ``position`` t defaults to seq_len // 2 - 1 (positions 0..t are compared in ``future``).
    ``atol`` is the change, relative to a layer's largest value, counted as a change (the
    perturbation checks are exact; the incremental one differs by float rounding).
    """
    from lmforge.utils.errors import LmforgeError

    cfg = model.config
    if batch < 2:
        raise LmforgeError(f"probe needs --batch >= 2 (one row against the others), got {batch}")
    if not 2 <= seq_len <= cfg.context_length:
        raise LmforgeError(
            f"probe --seq-len must be in 2..{cfg.context_length} (model.context_length), "
            f"got {seq_len}"
        )
    t = seq_len // 2 - 1 if position is None else position
    if not 0 <= t < seq_len - 1:
        raise LmforgeError(f"probe --position must be in 0..{seq_len - 2}, got {t}")
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise LmforgeError(f"unknown probe check {unknown[0]!r} (known: {', '.join(CHECKS)})")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    v = cfg.vocab_size
    ids = torch.randint(0, v, (batch, seq_len), generator=gen).to(device)
    n = cfg.n_layers
    changes: list[LayerChange] = []
    # Same shapes run twice: bit-identical on CPU; a hundredth of atol absorbs GPU kernels
    # whose reduction order may vary from run to run. A leak changes values by far more.
    exact = atol * 1e-2
    try:
        ref = _full(model, ids)
        if "future" in checks:
            later = torch.zeros_like(ids, dtype=torch.bool)
            later[:, t + 1 :] = True
            new = _full(model, _replace_tokens(ids, later, v, gen))
            changes += _compare("future", ref, new, slice(None), slice(0, t + 1), exact, n)
        if "other_rows" in checks:
            others = torch.zeros_like(ids, dtype=torch.bool)
            others[1:] = True
            new = _full(model, _replace_tokens(ids, others, v, gen))
            changes += _compare("other_rows", ref, new, slice(0, 1), slice(None), exact, n)
        if "incremental" in checks:
            new = _incremental(model, ids)
            changes += _compare("incremental", ref, new, slice(None), slice(None), atol, n)
    finally:
        model.train(was_training)
    routing = cfg.moe.routing if cfg.moe.enabled else "dense"
    return CausalityReport(changes, batch, seq_len, t, routing)
