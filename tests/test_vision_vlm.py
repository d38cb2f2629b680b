"""The LLaVA-style VLM: splice, one-forward path, objectives and accuracy (lmforge.vision.vlm)."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import WordTokenizer
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.vlm import (
    VisionLanguageModel,
    VLMObjective,
    build_example,
    collate,
    question_accuracy,
    splice_image_embeds,
)

TOK = WordTokenizer(vocabulary())
VIT = ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2)


def _vlm(seed: int = 0) -> VisionLanguageModel:
    torch.manual_seed(seed)
    lm = TransformerLM(
        ModelConfig(vocab_size=TOK.vocab_size, context_length=96, d_model=32, n_layers=2, n_heads=2)
    )
    return VisionLanguageModel(ViT(VIT), lm, TOK.image_id)


def test_splice_matches_loop_reference() -> None:
    torch.manual_seed(0)
    tokens = torch.tensor([[2, 4, 4, 7, 4, 4], [4, 4, 9, 9, 9, 3]])
    emb = torch.randn(2, 6, 5)
    img = torch.randn(3, 2, 5)
    out = splice_image_embeds(emb, tokens, img, 4)
    ref = emb.clone()
    flat = iter(img.reshape(-1, 5))
    for b in range(2):
        for t in range(6):
            if tokens[b, t] == 4:
                ref[b, t] = next(flat)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="5 <image> slots but 6"):
        splice_image_embeds(emb[:, :5], tokens[:, :5], img, 4)


def test_vlm_forward_runs_the_lm_layers_on_spliced_embeddings() -> None:
    model = _vlm().double()
    images = torch.randn(2, 3, 24, 24, dtype=torch.float64)
    n = model.n_image_tokens
    tokens = torch.tensor([[TOK.bos_id] + [TOK.image_id] * n + [10, 11]] * 2)
    logits = model(tokens, images)
    # by hand: lookup, splice, blocks, final norm, head
    lm = model.lm
    x = lm.token_embeddings(tokens).clone()
    x[:, 1 : 1 + n] = model.projector(model.vision(images)[1])
    for layer in lm.layers:
        x = layer(x)
    torch.testing.assert_close(logits, lm.logits_from_hidden(lm.ln_final(x)))
    # image tokens matter, text positions before them do not see them (causal)
    other = model(tokens, images.flip(0))
    assert not torch.allclose(logits[0, -1], other[0, -1])
    torch.testing.assert_close(logits[:, 0], other[:, 0])


def test_examples_collate_and_objective_loss_decreases() -> None:
    scenes = ProceduralScenes(seed=1, image_size=24, max_objects=2)
    s = scenes[0]
    ids, mask = build_example(TOK, 9, "caption", "answer", s, s.qa[0])
    assert TOK.decode(ids).startswith("<bos> " + s.caption)
    assert TOK.decode([i for i, m in zip(ids, mask, strict=True) if m]) == s.qa[0].answer + " <eos>"
    x, y = collate([(ids, mask), ([2, 5, 3], [False, True, True])], TOK.pad_id)
    assert x.shape == y.shape == (2, len(ids) - 1)
    assert (y[1, 2:] == -100).all() and y[1, 0] == 5

    model = _vlm()
    model.vision.requires_grad_(False)
    obj = VLMObjective(scenes, TOK, model.n_image_tokens, 8, "image", "answer")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batch = obj.next_batch()
    assert batch[2].shape == (8, 3, 24, 24) and obj.state_dict() == {"position": 8}
    losses = []
    for _ in range(15):
        total, weight = obj.loss(model, batch)
        loss = total / weight
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    acc = question_accuracy(model, scenes, TOK, "image", model.n_image_tokens, n_scenes=4)
    assert set(acc) >= {"acc", "acc_count"} and 0.0 <= acc["acc"] <= 1.0


def test_run_vlm_end_to_end(tmp_path) -> None:
    import json

    from lmforge.utils.config import load_config
    from lmforge.vision.contrastive import ContrastiveRunConfig, pretrain
    from lmforge.vision.vlm_train import VLMRunConfig, run_vlm

    enc = load_config(ContrastiveRunConfig, None, [
        "vision.image_size=24", "vision.d_model=32", "vision.n_layers=1", "vision.n_heads=2",
        "text.d_model=32", "text.n_layers=1", "text.n_heads=2", "joint.embed_dim=16",
        "data.val_size=8", "data.render_size=24", "train.batch_size=4", "train.steps=1",
        "train.warmup=1", f"train.out={tmp_path / 'enc'}",
    ])  # fmt: skip
    pretrain(enc, log=lambda r: None)
    cfg = load_config(VLMRunConfig, None, [
        "lm.d_model=32", "lm.n_layers=1", "lm.n_heads=2", "vlm.batch_size=4", "vlm.text_steps=2",
        "vlm.stage1_steps=2", "vlm.stage2_steps=2", "vlm.warmup=1", "vlm.eval_scenes=3",
        f"vlm.out={tmp_path / 'vlm'}",
    ])  # fmt: skip
    res = run_vlm(cfg, tmp_path / "enc", log=lambda r: None)
    assert set(res) == {"upper", "lower", "stage1", "stage2"}
    assert all(0.0 <= r["acc"] <= 1.0 for r in res.values())
    assert json.loads((tmp_path / "vlm" / "results.json").read_text()) == res
    # each phase ran in the Trainer; stage 1 moved only the projector, stage 2 not the ViT
    from lmforge.checkpoint import latest_checkpoint, load_model_state

    def weights(folder):
        return load_model_state(latest_checkpoint(folder) / "model.safetensors")

    enc_w, text_w = weights(tmp_path / "enc" / "train"), weights(tmp_path / "vlm" / "text")
    s1, s2 = weights(tmp_path / "vlm" / "stage1"), weights(tmp_path / "vlm" / "stage2")
    for k, w in text_w.items():
        assert torch.equal(s1[f"lm.{k}"], w), k
    assert any(not torch.equal(s2[f"lm.{k}"], w) for k, w in text_w.items())
    for k in (k for k in s2 if k.startswith("vision.")):
        assert torch.equal(s2[k], s1[k]) and torch.equal(s2[k], enc_w[k]), k
    assert all(not torch.equal(s1[k], s2[k]) for k in s1 if k.startswith("projector."))
    # the run folder serves: lmforge.vision.serving.load_vlm reads stage 2's weights back
    from lmforge.vision.serving import load_vlm

    loaded = load_vlm(tmp_path / "vlm")
    for k, w in loaded.lm.state_dict().items():
        assert torch.equal(w, s2[f"lm.{k}"]), k
    for k, w in loaded.tower.state_dict().items():
        assert torch.equal(w, s2[k]), k
    assert loaded.tower.n_image_tokens == 9 and loaded.tokenizer.vocab_size == TOK.vocab_size
    with pytest.raises(LmforgeError, match="not a `vision pretrain` run"):
        run_vlm(cfg, tmp_path / "nothing", log=lambda r: None)
