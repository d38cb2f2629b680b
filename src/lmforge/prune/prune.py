"""Width and depth pruning: a smaller valid :class:`~lmforge.model.ModelConfig` and its weights.

Width (Minitron): keep the most important residual channels (``d_model``), FFN hidden channels
(``d_ff``, per layer by that layer's scores) and query heads (per kv-head group, the same number
in every group so grouped-query attention stays valid; the head dim is kept and written into
the config explicitly). Every matrix is sliced — embeddings and LM head by columns, q/k/v and
w1/w3 by input columns, output_proj/w2 by output rows, norms by entries — so the pruned model
is the original restricted to the kept structures. (RMSNorm then averages over the kept
channels only: the function changes a little, which distillation recovers.) Depth (ShortGPT):
drop the blocks with the lowest Block Influence and renumber the rest.

:func:`plan_width` / :func:`plan_depth` choose the shape for a parameter target: depth removes
the least influential blocks until the count fits; width shrinks d_model and d_ff by one common
factor (multiples of 64 and of 32), found by bisection, keeping every head.
Exercised by ``pytest tests/test_prune.py`` and ``lmforge prune``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmforge.prune.importance import Importance
from lmforge.utils.errors import LmforgeError

__all__ = ["count_parameters", "plan_depth", "plan_width", "prune_depth", "prune_width"]


def count_parameters(cfg) -> int:
    """Distinct parameters of a TransformerLM with ``cfg`` (built on the meta device)."""
    from lmforge.model import TransformerLM

    return TransformerLM(cfg, device="meta").num_parameters()


def _check_dense(model: nn.Module) -> None:
    from lmforge.model import SwiGLU

    if not all(isinstance(layer.ffn, SwiGLU) for layer in model.layers):
        raise LmforgeError("pruning supports dense SwiGLU blocks only (not mixture-of-experts)")
    if getattr(model.config, "kv_share_every", 1) > 1:
        raise LmforgeError(
            "pruning does not support cross-layer KV sharing (model.kv_share_every > 1):"
            " consumer layers have no K/V projections of their own"
        )


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, in increasing index order (keeps the layout)."""
    return torch.sort(torch.topk(scores, k).indices).values


@torch.no_grad()
def prune_width(
    model: nn.Module,
    imp: Importance,
    *,
    d_model: int | None = None,
    d_ff: int | None = None,
    heads_per_group: int | None = None,
) -> nn.Module:
    """A new TransformerLM keeping the ``d_model`` residual channels, ``d_ff`` FFN channels per
    layer and ``heads_per_group`` query heads per kv head with the highest scores (None: all)."""

    _check_dense(model)
    cfg = model.config
    h, kv, e = cfg.n_heads, cfg.kv_heads, int(cfg.head_dim)
    g = h // kv
    d_model = cfg.d_model if d_model is None else d_model
    d_ff = cfg.ffn_dim if d_ff is None else d_ff
    g_new = g if heads_per_group is None else heads_per_group
    if not (0 < d_model <= cfg.d_model and 0 < d_ff <= cfg.ffn_dim and 0 < g_new <= g):
        raise LmforgeError(
            f"pruned sizes must be within the model's: d_model {d_model}/{cfg.d_model}, "
            f"d_ff {d_ff}/{cfg.ffn_dim}, heads per kv group {g_new}/{g}"
        )
    new_cfg = dataclasses.replace(
        cfg, d_model=d_model, d_ff=d_ff, n_heads=kv * g_new, n_kv_heads=kv, head_dim=e
    )
    keep_d = _top(imp.hidden, d_model)  # (D',)
    old = model.state_dict()
    state: dict[str, torch.Tensor] = {
        "token_embeddings.weight": old["token_embeddings.weight"][:, keep_d],
        "lm_head.weight": old["lm_head.weight"][:, keep_d],
        "ln_final.weight": old["ln_final.weight"][keep_d],
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        # query heads: the best g_new of each kv group, groups in order
        per_group = imp.heads[i].reshape(kv, g)  # (K, g)
        heads = torch.cat([grp * g + _top(per_group[grp], g_new) for grp in range(kv)])
        rows = (heads[:, None] * e + torch.arange(e)[None, :]).reshape(-1)  # (H'·E,)
        keep_f = _top(imp.ffn[i], d_ff)  # (F',)
        state[p + "ln1.weight"] = old[p + "ln1.weight"][keep_d]
        state[p + "ln2.weight"] = old[p + "ln2.weight"][keep_d]
        state[p + "attn.q_proj.weight"] = old[p + "attn.q_proj.weight"][rows][:, keep_d]
        if p + "attn.gate_proj.weight" in old:  # the output gate: one row block per query head
            state[p + "attn.gate_proj.weight"] = old[p + "attn.gate_proj.weight"][rows][:, keep_d]
        state[p + "attn.k_proj.weight"] = old[p + "attn.k_proj.weight"][:, keep_d]
        state[p + "attn.v_proj.weight"] = old[p + "attn.v_proj.weight"][:, keep_d]
        state[p + "attn.output_proj.weight"] = old[p + "attn.output_proj.weight"][keep_d][:, rows]
        for name in ("attn.q_norm.weight", "attn.k_norm.weight"):
            if p + name in old:
                state[p + name] = old[p + name]
        state[p + "ffn.w1.weight"] = old[p + "ffn.w1.weight"][keep_f][:, keep_d]
        state[p + "ffn.w3.weight"] = old[p + "ffn.w3.weight"][keep_f][:, keep_d]
        state[p + "ffn.w2.weight"] = old[p + "ffn.w2.weight"][keep_d][:, keep_f]
    return _build(new_cfg, state, model)


@torch.no_grad()
def prune_depth(model: nn.Module, imp: Importance, n_layers: int) -> nn.Module:
    """A new TransformerLM keeping the ``n_layers`` blocks with the highest Block Influence."""
    _check_dense(model)
    cfg = model.config
    if not 0 < n_layers <= cfg.n_layers:
        raise LmforgeError(f"layers to keep must be in 1..{cfg.n_layers}, got {n_layers}")
    keep = _top(imp.layers, n_layers).tolist()
    old = model.state_dict()
    state = {k: v for k, v in old.items() if not k.startswith("layers.")}
    for new_i, old_i in enumerate(keep):
        prefix = f"layers.{old_i}."
        for k, v in old.items():
            if k.startswith(prefix):
                state[f"layers.{new_i}." + k[len(prefix) :]] = v
    return _build(dataclasses.replace(cfg, n_layers=n_layers), state, model)


def _build(cfg, state: dict[str, torch.Tensor], like: nn.Module) -> nn.Module:
    from lmforge.model import TransformerLM

    dev = next(like.parameters()).device
    model = TransformerLM(cfg, device=dev, dtype=next(like.parameters()).dtype)
    model.load_state_dict({k: v.contiguous().clone() for k, v in state.items()})
    return model.eval()


def plan_depth(cfg, imp: Importance, target_params: int) -> int:
    """The most blocks whose model has at most ``target_params`` parameters."""
    for n in range(cfg.n_layers, 0, -1):
        if count_parameters(dataclasses.replace(cfg, n_layers=n)) <= target_params:
            return n
    raise LmforgeError(f"even one block exceeds --target-params {target_params}")


def plan_width(cfg, target_params: int) -> tuple[int, int]:
    """``(d_model, d_ff)``: both shrunk by one factor r (d_model to a multiple of 32, d_ff to a
    multiple of 64), the largest r whose model has at most ``target_params`` parameters."""
    e = int(cfg.head_dim)

    def shape(r: float) -> tuple[int, int]:
        d = max(32, int(cfg.d_model * r) // 32 * 32)
        f = max(64, int(cfg.ffn_dim * r) // 64 * 64)
        return d, f

    def params(r: float) -> int:
        d, f = shape(r)
        return count_parameters(dataclasses.replace(cfg, d_model=d, d_ff=f, head_dim=e))

    if params(1.0) <= target_params:
        return cfg.d_model, cfg.ffn_dim
    lo, hi = 0.0, 1.0
    if params(1e-9) > target_params:
        raise LmforgeError(f"no width reaches --target-params {target_params}")
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if params(mid) <= target_params else (lo, mid)
    return shape(lo)
