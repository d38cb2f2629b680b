"""CLIP/SigLIP vision towers from transformers folders: features equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from lmforge.utils.errors import LmforgeError
from lmforge.vision.hf import load_hf_vision_tower

transformers = pytest.importorskip("transformers")


def _tiny(kind: str):
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=24, patch_size=8)  # fmt: skip
    if kind == "clip":
        return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
    return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tower_features_equal_transformers(tmp_path, kind: str) -> None:
    torch.manual_seed(0)
    ref = _tiny(kind).eval()
    with torch.no_grad():  # non-zero class embedding / probe so every parameter matters
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    tower = load_hf_vision_tower(tmp_path)
    assert tower.config.n_patches == 9
    images = torch.randn(3, 3, 24, 24)
    with torch.no_grad():
        out = ref(pixel_values=images)
        pooled, patches = tower(images)
    hidden = out.last_hidden_state if kind == "siglip" else out.last_hidden_state[:, 1:]
    torch.testing.assert_close(patches, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, out.pooler_output, rtol=1e-5, atol=1e-5)


def test_tower_plugs_into_the_vlm(tmp_path) -> None:
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.vision.vlm import VisionLanguageModel

    _tiny("clip").save_pretrained(tmp_path)
    tower = load_hf_vision_tower(tmp_path)
    lm = TransformerLM(
        ModelConfig(vocab_size=16, context_length=32, d_model=16, n_layers=1, n_heads=2)
    )
    vlm = VisionLanguageModel(tower, lm, image_id=4)
    tokens = torch.tensor([[2] + [4] * 9 + [7]])
    assert vlm(tokens, torch.randn(1, 3, 24, 24)).shape == (1, 11, 16)


def test_bad_folders_are_one_line(tmp_path) -> None:
    with pytest.raises(LmforgeError, match=r"no config\.json"):
        load_hf_vision_tower(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(LmforgeError, match="not CLIP or SigLIP"):
        load_hf_vision_tower(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"model_type": "clip_vision_model", "image_size": 24, "patch_size": 8, "hidden_size": 32,'
        ' "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 48}'
    )
    with pytest.raises(LmforgeError, match="cannot read"):
        load_hf_vision_tower(tmp_path)
