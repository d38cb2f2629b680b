"""Multimodal lmforge: procedural image–text data, a ViT and text encoder trained contrastively
(CLIP / SigLIP), a LLaVA-style VLM on an lmforge ``TransformerLM``, and a VQ-VAE for discrete
image tokens; serving a VLM (image decoding, embeddings, the checkpoint loader). This is the
public API; the command is ``lmforge vision --help``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.vision.contrastive import ContrastiveRunConfig, pretrain
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
    from lmforge.vision.mrope import image_spans, mrope_positions
    from lmforge.vision.scenes import QA, ProceduralScenes, Scene, SceneSample
    from lmforge.vision.serving import (
        ImagePrompt,
        LoadedVLM,
        VisionTower,
        VLMTokenizer,
        decode_data_url,
        decode_image,
        expand_placeholders,
        image_pixels,
        load_vlm,
        prepare_image_prompt,
    )
    from lmforge.vision.vlm import Projector, VisionLanguageModel, VLMObjective, splice_image_embeds
    from lmforge.vision.vlm_train import VLMRunConfig, run_vlm
    from lmforge.vision.vq_train import VQRunConfig, run_vq
    from lmforge.vision.vqvae import VQVAE, CodebookUpdate, EMACodebook, VQConfig

__all__ = [
    "QA",
    "VQVAE",
    "CodebookUpdate",
    "ContrastiveRunConfig",
    "DualEncoder",
    "EMACodebook",
    "HFVisionTower",
    "ImagePrompt",
    "LoadedVLM",
    "ProceduralScenes",
    "Projector",
    "Scene",
    "SceneSample",
    "TextConfig",
    "TextEncoder",
    "VLMObjective",
    "VLMRunConfig",
    "VLMTokenizer",
    "VQConfig",
    "VQRunConfig",
    "ViT",
    "ViTConfig",
    "VisionLanguageModel",
    "VisionTower",
    "WordTokenizer",
    "clip_loss",
    "decode_data_url",
    "decode_image",
    "encode_batch",
    "expand_placeholders",
    "image_pixels",
    "image_spans",
    "iter_image_folder",
    "iter_tar_shards",
    "load_hf_vision_tower",
    "load_image",
    "load_vlm",
    "mrope_positions",
    "prepare_image_prompt",
    "preprocess",
    "pretrain",
    "retrieval_recall",
    "run_vlm",
    "run_vq",
    "siglip_loss",
    "splice_image_embeds",
]

_EXPORTS = {
    "ImagePrompt": "serving",
    "LoadedVLM": "serving",
    "VLMTokenizer": "serving",
    "VisionTower": "serving",
    "decode_data_url": "serving",
    "decode_image": "serving",
    "expand_placeholders": "serving",
    "image_pixels": "serving",
    "load_vlm": "serving",
    "prepare_image_prompt": "serving",
    "ContrastiveRunConfig": "contrastive",
    "VLMRunConfig": "vlm_train",
    "VQRunConfig": "vq_train",
    "pretrain": "contrastive",
    "run_vlm": "vlm_train",
    "run_vq": "vq_train",
    "CodebookUpdate": "vqvae",
    "DualEncoder": "encoders",
    "EMACodebook": "vqvae",
    "HFVisionTower": "hf",
    "ProceduralScenes": "scenes",
    "Projector": "vlm",
    "QA": "scenes",
    "Scene": "scenes",
    "SceneSample": "scenes",
    "TextConfig": "encoders",
    "TextEncoder": "encoders",
    "VLMObjective": "vlm",
    "VQConfig": "vqvae",
    "VQVAE": "vqvae",
    "ViT": "encoders",
    "ViTConfig": "encoders",
    "VisionLanguageModel": "vlm",
    "WordTokenizer": "data",
    "clip_loss": "losses",
    "encode_batch": "data",
    "iter_image_folder": "data",
    "iter_tar_shards": "data",
    "load_hf_vision_tower": "hf",
    "load_image": "data",
    "preprocess": "data",
    "retrieval_recall": "losses",
    "siglip_loss": "losses",
    "splice_image_embeds": "vlm",
    "image_spans": "mrope",
    "mrope_positions": "mrope",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
