"""Bring a real encoder: CLIP and SigLIP vision towers read from a Hugging Face folder.

HF's towers differ from :class:`~lmforge.vision.encoders.ViT` (LayerNorm with bias, GELU MLP,
biased projections; CLIP adds a class token and a pre-norm, SigLIP has no class token and pools
with a multi-head attention probe), so :class:`HFVisionTower` writes their forward out in plain
torch with HF's parameter names, loads ``model.safetensors`` (safetensors only: no pickle) and
exposes the ViT's interface — ``config`` (image_size, patch_size, d_model, n_patches) and
``forward(images) -> (pooled (B, D), patch tokens (B, N, D))`` — so a
:class:`~lmforge.vision.vlm.VisionLanguageModel` can sit on it unchanged. The patch tokens are
those a LLaVA reads: CLIP's last hidden states without the class token; SigLIP's after its
post-norm. Exercised by ``pytest tests/test_vision_hf.py`` (features equal to ``transformers``).

Shape legend: B batch, N patches, D width, H heads, E head dim.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.utils.errors import LmforgeError

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclasses.dataclass(frozen=True)
class HFTowerConfig:
    """The fields of a transformers CLIP/SigLIP vision config that the forward needs."""

    kind: str
    "clip or siglip"
    image_size: int
    patch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    act: str
    eps: float

    @property
    def n_patches(self) -> int:
        """Patches per image (N)."""
        return (self.image_size // self.patch_size) ** 2


class _Layer(nn.Module):
    def __init__(self, c: HFTowerConfig) -> None:
        super().__init__()
        d = c.d_model
        self.layer_norm1 = nn.LayerNorm(d, eps=c.eps)
        self.self_attn = nn.ModuleDict(
            {n: nn.Linear(d, d) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
        )
        self.layer_norm2 = nn.LayerNorm(d, eps=c.eps)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(d, c.d_ff), "fc2": nn.Linear(c.d_ff, d)})
        self.n_heads, self.act = c.n_heads, _ACTIVATIONS[c.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D): pre-LN attention, then pre-LN MLP."""
        b, t, d = x.shape
        h = self.layer_norm1(x)
        a = self.self_attn
        q, k, v = (
            a[n](h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, H, T, E)
            for n in ("q_proj", "k_proj", "v_proj")
        )
        o = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, E)
        x = x + a["out_proj"](o.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](self.layer_norm2(x))))


class HFVisionTower(nn.Module):
    """A transformers CLIP or SigLIP vision tower with lmforge's ViT interface."""

    def __init__(self, config: HFTowerConfig) -> None:
        super().__init__()
        self.config = c = config
        d = c.d_model
        siglip = c.kind == "siglip"
        emb = nn.Module()
        emb.patch_embedding = nn.Conv2d(3, d, c.patch_size, c.patch_size, bias=siglip)
        emb.position_embedding = nn.Embedding(c.n_patches + (0 if siglip else 1), d)
        if not siglip:
            emb.class_embedding = nn.Parameter(torch.zeros(d))
            self.pre_layrnorm = nn.LayerNorm(d, eps=c.eps)
        self.embeddings = emb
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(c) for _ in range(c.n_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=c.eps)
        if siglip:
            head = nn.Module()
            head.probe = nn.Parameter(torch.zeros(1, 1, d))
            head.attention = nn.MultiheadAttention(d, c.n_heads, batch_first=True)
            head.layernorm = nn.LayerNorm(d, eps=c.eps)
            head.mlp = nn.ModuleDict({"fc1": nn.Linear(d, c.d_ff), "fc2": nn.Linear(c.d_ff, d)})
            self.head = head

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, S, S) pixels normalised as the tower expects -> (pooled (B, D), patches (B, N, D))."""
        c, emb = self.config, self.embeddings
        x = emb.patch_embedding(images).flatten(2).transpose(1, 2)  # (B, N, D)
        if c.kind == "clip":
            cls = emb.class_embedding.expand(x.shape[0], 1, -1)  # (B, 1, D)
            x = torch.cat([cls, x], 1) + emb.position_embedding.weight  # (B, 1+N, D)
            x = self.pre_layrnorm(x)
            for layer in self.encoder.layers:
                x = layer(x)
            return self.post_layernorm(x[:, 0]), x[:, 1:]
        x = x + emb.position_embedding.weight  # (B, N, D)
        for layer in self.encoder.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        head = self.head
        probe = head.probe.expand(x.shape[0], 1, -1)  # (B, 1, D)
        pooled = head.attention(probe, x, x, need_weights=False)[0]  # (B, 1, D)
        act = _ACTIVATIONS[c.act]
        pooled = pooled + head.mlp["fc2"](act(head.mlp["fc1"](head.layernorm(pooled))))
        return pooled[:, 0], x


def _tower_config(raw: dict, folder: Path) -> HFTowerConfig:
    model_type = raw.get("model_type", "")
    vision = raw.get("vision_config", raw)  # a full CLIP/SigLIP config nests the tower's
    kind = "siglip" if "siglip" in model_type else "clip" if "clip" in model_type else ""
    if not kind:
        raise LmforgeError(f"{folder}/config.json: model_type {model_type!r} is not CLIP or SigLIP")
    defaults = {"clip": ("quick_gelu", 1e-5), "siglip": ("gelu_pytorch_tanh", 1e-6)}[kind]
    try:
        act = vision.get("hidden_act", defaults[0])
        if act not in _ACTIVATIONS:
            raise LmforgeError(f"{folder}/config.json: hidden_act {act!r} is not supported")
        return HFTowerConfig(
            kind=kind,
            image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]),
            d_model=int(vision["hidden_size"]),
            n_layers=int(vision["num_hidden_layers"]),
            n_heads=int(vision["num_attention_heads"]),
            d_ff=int(vision["intermediate_size"]),
            act=act,
            eps=float(vision.get("layer_norm_eps", defaults[1])),
        )
    except KeyError as e:
        raise LmforgeError(f"{folder}/config.json: missing vision key {e}") from None


def load_hf_vision_tower(folder: str | Path) -> HFVisionTower:
    """The CLIP/SigLIP vision tower of a transformers folder (``config.json`` +
    ``model.safetensors``; a full dual-encoder checkpoint works too: its ``vision_model.``
    weights are taken). One error line for a missing or mismatched file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, weights = folder / "config.json", folder / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise LmforgeError(f"{folder}: no {p.name} (expected a transformers model folder)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LmforgeError(f"{cfg_path}: not valid JSON ({e})") from None
    tower = HFVisionTower(_tower_config(raw, folder))
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise LmforgeError(f"cannot read {weights}: {e}") from None
    # a full dual encoder (and older transformers' vision models) prefix the tower's weights
    prefix = "vision_model." if any(k.startswith("vision_model.") for k in state) else ""
    # position_ids is a buffer some transformers versions save; the tower derives positions
    state = {
        k[len(prefix) :]: v
        for k, v in state.items()
        if k.startswith(prefix) and not k.endswith("position_ids")
    }
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise LmforgeError(
            f"{weights}: weights do not fit the tower (missing {missing[:3]}, unexpected"
            f" {unexpected[:3]})"
        )
    return tower.eval()
