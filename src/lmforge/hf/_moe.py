"""Qwen3-MoE interop for MoE models (the MoE half of :mod:`lmforge.hf.convert`).

lmforge's MoE (``model.moe``) with softmax scores, dropless token choice, no shared experts and
QK-norm is Qwen3-MoE (``Qwen3MoeForCausalLM``): ``layers.i.ffn.router.weight`` →
``model.layers.i.mlp.gate.weight``; expert e of the stacked ``ffn.w1`` / ``w3`` / ``w2`` →
``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj`` (the hub's per-expert layout, which
transformers ≥ 5 fuses on load); ``moe.every`` ↔ ``decoder_sparse_step``;
``moe.first_dense_layers = k`` ↔ ``mlp_only_layers = [0, …, k-1]``; ``norm_top_k`` ↔
``norm_topk_prob``; dense layers keep ``mlp.{gate,up,down}_proj`` with ``intermediate_size``.
Import also accepts the fused layout (``mlp.experts.gate_up_proj`` (N, 2F, D),
``mlp.experts.down_proj`` (N, D, F)). The stacked-expert converters (:func:`stacked_to_hf`,
:func:`stacked_from_hf`) serve DeepSeek-V3 too (:mod:`lmforge.hf.deepseek`). Exercised by
``pytest tests/test_moe_hf.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.model.config import ModelConfig
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def check_exportable(cfg: ModelConfig) -> None:
    """Raise one line for an MoE option Qwen3-MoE has no place for."""
    mc = cfg.moe
    problems = [
        (not cfg.qk_norm, "model.qk_norm = false (Qwen3-MoE always RMS-normalises q and k)"),
        (mc.n_shared_experts > 0, "model.moe.n_shared_experts > 0 (Qwen3-MoE has none)"),
        (mc.score != "softmax", f"model.moe.score = '{mc.score}' (Qwen3-MoE uses softmax)"),
        (mc.routing != "token_choice", f"model.moe.routing = '{mc.routing}' (Qwen3-MoE: top-k)"),
        (mc.n_groups > 1, "model.moe.n_groups > 1 (Qwen3-MoE has no group-limited routing)"),
        (mc.routed_scale != 1.0, "model.moe.routed_scale != 1 (Qwen3-MoE does not scale)"),
    ]
    for bad, what in problems:
        if bad:
            raise LmforgeError(f"cannot export as Qwen3-MoE: {what}")


def stacked_to_hf(state: dict[str, torch.Tensor], lm: str, hf: str) -> dict[str, torch.Tensor]:
    """One MoE layer's stacked experts (``{lm}w1`` (N, F, D), ``w3``, ``w2`` (N, D, F)) as the
    hub's per-expert tensors ``{hf}{e}.gate_proj.weight`` etc. (``hf`` ends in ``experts.``)."""
    out: dict[str, torch.Tensor] = {}
    for a, b in _PROJ:
        w = state[lm + a].detach().to("cpu")  # (N, F, D) or (N, D, F)
        for e in range(w.shape[0]):
            out[f"{hf}{e}.{b}.weight"] = w[e].contiguous()
    return out


def stacked_from_hf(
    hf_state: dict[str, torch.Tensor],
    n: int,
    lm: str,
    hf: str,
    state: dict[str, torch.Tensor],
    used: set[str],
    source: str,
) -> None:
    """The inverse of :func:`stacked_to_hf` into ``state`` (fp32), from the per-expert names or
    transformers ≥ 5's fused ones (``{hf}gate_up_proj`` (N, 2F, D), ``{hf}down_proj`` (N, D,
    F)); the names read are added to ``used``; a missing tensor is one line."""
    fused = hf + "gate_up_proj"
    if fused in hf_state:
        gate_up = hf_state[fused].to(torch.float32)  # (N, 2F, D)
        f = gate_up.shape[1] // 2
        state[lm + "w1"] = gate_up[:, :f].contiguous()  # (N, F, D)
        state[lm + "w3"] = gate_up[:, f:].contiguous()  # (N, F, D)
        state[lm + "w2"] = hf_state[hf + "down_proj"].to(torch.float32)  # (N, D, F)
        used.update({fused, hf + "down_proj"})
        return
    for a, b in _PROJ:
        names = [f"{hf}{e}.{b}.weight" for e in range(n)]
        missing = [k for k in names if k not in hf_state]
        if missing:
            raise LmforgeError(f"{source}: tensor '{missing[0]}' is missing")
        state[lm + a] = torch.stack([hf_state[k].to(torch.float32) for k in names])  # (N, ., .)
        used.update(names)


def experts_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The per-expert HF tensors of every MoE layer (router names are in the shared table).
    Checks first that Qwen3-MoE can represent ``cfg`` (before an export writes anything)."""
    check_exportable(cfg)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.n_layers):
        if not cfg.moe.is_moe_layer(i):
            continue
        bias = state.get(f"layers.{i}.ffn.expert_bias")
        if bias is not None and bool(bias.abs().sum() > 0):
            raise LmforgeError(
                f"cannot export as Qwen3-MoE: layer {i} has a non-zero expert selection bias "
                "(aux-loss-free balancing), which Qwen3-MoE's router has no place for"
            )
        out.update(stacked_to_hf(state, f"layers.{i}.ffn.", f"model.layers.{i}.mlp.experts."))
    return out


def experts_from_hf(
    hf_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    used: set[str],
    source: str,
) -> None:
    """Fill ``state`` with every MoE layer's stacked experts (and a zero bias) from HF tensors,
    per-expert or fused; the names read are added to ``used``."""
    n = cfg.moe.n_experts
    for i in range(cfg.n_layers):
        if not cfg.moe.is_moe_layer(i):
            continue
        lm, hf = f"layers.{i}.ffn.", f"model.layers.{i}.mlp.experts."
        stacked_from_hf(hf_state, n, lm, hf, state, used, source)
        state[lm + "expert_bias"] = torch.zeros(n)


def hf_config(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE ``config.json`` from the dense one ``base`` (Qwen3) written for ``cfg``."""
    check_exportable(cfg)
    mc = cfg.moe
    out = dict(base)
    out.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=mc.n_experts,
        num_experts_per_tok=mc.top_k,
        moe_intermediate_size=cfg.expert_dim,
        decoder_sparse_step=mc.every,
        norm_topk_prob=mc.norm_top_k,
        mlp_only_layers=list(range(min(mc.first_dense_layers, cfg.n_layers))),
        router_aux_loss_coef=mc.aux_loss_coef,
        output_router_logits=False,
    )
    return out


def moe_from_hf(hf: dict[str, Any], where: str) -> MoEConfig:
    """The :class:`MoEConfig` of a Qwen3-MoE ``config.json`` (default for other types)."""
    if hf.get("model_type") != "qwen3_moe":
        return MoEConfig()
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise LmforgeError(
            f"{where}: mlp_only_layers {dense} is not supported (only the first k layers"
            " dense: model.moe.first_dense_layers)"
        )
    try:
        return MoEConfig(
            n_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            top_k=int(hf["num_experts_per_tok"]),
            expert_d_ff=int(hf["moe_intermediate_size"]),
            every=int(hf.get("decoder_sparse_step", 1)),
            first_dense_layers=len(dense),
            norm_top_k=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    except KeyError as e:
        raise LmforgeError(f"{where}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None
