"""The mixture-of-experts branch of the model config (``[model.moe]`` in a run TOML).

Pure data (no torch), imported by :mod:`lmforge.model.config`. ``n_experts = 0`` (the default)
is a dense model; the layer itself lives in :mod:`lmforge.model.moe`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

Routing = Literal["token_choice", "token_choice_capacity", "expert_choice"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward options; ``n_experts = 0`` keeps every layer dense."""

    n_experts: int = 0
    "routed experts per MoE layer (0 = dense model, no MoE layers)"
    top_k: int = 2
    "experts chosen per token (token_choice*); expert_choice: the average experts per token"
    n_shared_experts: int = 0
    "always-on experts added to every token's output (DeepSeek-MoE): one SwiGLU of width"
    " n_shared_experts · expert_d_ff (DeepSeek-V3's shared_experts)"
    shared_gate: bool = False
    "scale the shared experts' output per token by σ(x W_g), W_g a learned D → 1 projection"
    " (Qwen3-Next's shared_expert_gate); needs n_shared_experts > 0"
    expert_d_ff: int | None = None
    "hidden size of one expert (None = model.d_ff; smaller = fine-grained experts)"
    every: int = 1
    "MoE on every k-th layer: layer i (0-based) is MoE when (i + 1) % every == 0 (Qwen3-MoE's"
    " decoder_sparse_step); the others stay dense"
    first_dense_layers: int = 0
    "the first k layers (0-based i < k) keep the dense FFN whatever ``every`` says"
    " (DeepSeek-V3's first_k_dense_replace = 3; MTP blocks count after the trunk's layers)"
    score: Literal["softmax", "sigmoid"] = "softmax"
    "router score: softmax over experts (Switch, Qwen3-MoE) or per-expert sigmoid (DeepSeek-V3)"
    norm_top_k: bool = True
    "divide the chosen experts' scores by their sum (Qwen3-MoE's norm_topk_prob)"
    routed_scale: float = 1.0
    "multiply the routed experts' gate weights (after norm_top_k) by this; shared experts are"
    " not scaled (DeepSeek-V3's routed_scaling_factor = 2.5)"
    n_groups: int = 1
    "group-limited routing (token choice): the N experts form n_groups equal groups, each"
    " token scores a group by the sum of its top-2 biased scores and picks its top_k experts"
    " from its top_groups groups only (DeepSeek-V3's n_group = 8; 1 = off)"
    top_groups: int = 1
    "groups a token may pick experts from when n_groups > 1 (DeepSeek-V3's topk_group = 4)"
    routing: Routing = "token_choice"
    "token_choice (top-k, dropless, causal), token_choice_capacity (top-k with a per-expert"
    " capacity over the batch, overflow dropped: NOT causal), expert_choice (each expert takes"
    " its top tokens of the batch: NOT causal)"
    capacity_factor: float = 1.25
    "expert capacity = capacity_factor · tokens · top_k / n_experts (the two non-causal routings)"
    aux_loss_coef: float = 0.01
    "Switch/GShard load-balancing loss weight α · N · Σ f_e · P_e (0 = off)"
    z_loss_coef: float = 0.0
    "router z-loss weight · mean(logsumexp(router logits)²) (ST-MoE uses 1e-3; 0 = off)"
    bias_update_rate: float = 0.0
    "DeepSeek-V3 auxiliary-loss-free balancing: after each step every expert's selection bias"
    " moves by ±rate toward the mean load (0 = off; DeepSeek-V3 used 1e-3)"
    backend: Literal["reference", "grouped", "auto"] = "auto"
    "expert compute: reference (loop over experts), grouped (tokens sorted by expert, one"
    " grouped GEMM per projection: torch._grouped_mm on CUDA, a loop over the sorted segments"
    " elsewhere), auto = grouped"
    allow_noncausal: bool = False
    "let the trainer train with a non-causal routing (expert_choice, token_choice_capacity)"

    def __post_init__(self) -> None:
        if self.n_experts < 0:
            raise ValueError(f"moe.n_experts must be >= 0, got {self.n_experts}")
        if self.n_shared_experts < 0:
            raise ValueError(f"moe.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.shared_gate and not self.n_shared_experts:
            raise ValueError("moe.shared_gate needs shared experts (moe.n_shared_experts > 0)")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"moe.top_k must be in 1..n_experts ({self.n_experts}), got {self.top_k}"
            )
        if self.expert_d_ff is not None and self.expert_d_ff <= 0:
            raise ValueError(f"moe.expert_d_ff must be positive, got {self.expert_d_ff}")
        if self.every < 1:
            raise ValueError(f"moe.every must be >= 1, got {self.every}")
        if self.first_dense_layers < 0:
            raise ValueError(f"moe.first_dense_layers must be >= 0, got {self.first_dense_layers}")
        if not (self.routed_scale > 0 and math.isfinite(self.routed_scale)):
            raise ValueError(f"moe.routed_scale must be positive, got {self.routed_scale}")
        self._check_groups()
        if self.capacity_factor <= 0:
            raise ValueError(f"moe.capacity_factor must be positive, got {self.capacity_factor}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} must be >= 0, got {getattr(self, name)}")
        hints = typing.get_type_hints(MoEConfig)
        for name in ("score", "routing", "backend"):
            allowed = typing.get_args(hints[name])
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"moe.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )

    def _check_groups(self) -> None:
        g, tg, n = self.n_groups, self.top_groups, self.n_experts
        if g < 1:
            raise ValueError(f"moe.n_groups must be >= 1, got {g}")
        if not 1 <= tg <= g:
            raise ValueError(f"moe.top_groups must be in 1..n_groups ({g}), got {tg}")
        if g == 1 or not n:
            return
        if n % g or n // g < 2:
            raise ValueError(
                f"moe.n_groups ({g}) must split moe.n_experts ({n}) into equal groups of at"
                " least 2 experts (a group is scored by its top-2 experts)"
            )
        if self.top_k > tg * (n // g):
            raise ValueError(
                f"moe.top_k ({self.top_k}) exceeds the experts of moe.top_groups ({tg}) groups"
                f" of {n // g}"
            )
        if self.routing == "expert_choice":
            raise ValueError("moe.n_groups > 1 needs a token-choice routing, not expert_choice")

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers at all."""
        return self.n_experts > 0

    @property
    def causal(self) -> bool:
        """Whether the routing keeps each token's output a function of that token alone."""
        return self.routing == "token_choice"  # the one such mode (see ``lmforge probe``)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` (0-based) gets the MoE feed-forward."""
        if not self.enabled or layer_idx < self.first_dense_layers:
            return False
        return (layer_idx + 1) % self.every == 0
