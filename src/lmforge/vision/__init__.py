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
from lmforge.vision.losses import clip_loss, retrieval_recall, siglip_loss
from lmforge.vision.scenes import QA, ProceduralScenes, Scene, SceneSample

__all__ = [
    "QA",
    "DualEncoder",
    "ProceduralScenes",
    "Scene",
    "SceneSample",
    "TextConfig",
    "TextEncoder",
    "ViT",
    "ViTConfig",
    "WordTokenizer",
    "clip_loss",
    "encode_batch",
    "iter_image_folder",
    "iter_tar_shards",
    "load_image",
    "preprocess",
    "retrieval_recall",
    "siglip_loss",
]
