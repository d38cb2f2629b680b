"""Multimodal lmforge: procedural image–text data, a ViT and text encoder trained contrastively
(CLIP / SigLIP), a LLaVA-style VLM on an lmforge ``TransformerLM``, and a VQ-VAE for discrete
image tokens. This is the public API; the command is ``lmforge vision --help``.
"""

from lmforge.vision.data import (
    WordTokenizer,
    encode_batch,
    iter_image_folder,
    iter_tar_shards,
    load_image,
    preprocess,
)
from lmforge.vision.encoders import DualEncoder, TextConfig, TextEncoder, ViT, ViTConfig
from lmforge.vision.hf import HFVisionTower, load_hf_vision_tower
from lmforge.vision.losses import clip_loss, retrieval_recall, siglip_loss
from lmforge.vision.scenes import QA, ProceduralScenes, Scene, SceneSample
from lmforge.vision.vlm import (
    Projector,
    VisionLanguageModel,
    VLMObjective,
    encode_image_for_prompt,
    splice_image_embeds,
)
from lmforge.vision.vqvae import VQVAE, EMACodebook, VQConfig

__all__ = [
    "QA",
    "VQVAE",
    "DualEncoder",
    "EMACodebook",
    "HFVisionTower",
    "ProceduralScenes",
    "Projector",
    "Scene",
    "SceneSample",
    "TextConfig",
    "TextEncoder",
    "VLMObjective",
    "VQConfig",
    "ViT",
    "ViTConfig",
    "VisionLanguageModel",
    "WordTokenizer",
    "clip_loss",
    "encode_batch",
    "encode_image_for_prompt",
    "iter_image_folder",
    "iter_tar_shards",
    "load_hf_vision_tower",
    "load_image",
    "preprocess",
    "retrieval_recall",
    "siglip_loss",
    "splice_image_embeds",
]
