"""VQ-VAE (straight-through, commitment, EMA codebook) and the interleaved image-token LM."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.model import ModelConfig, TransformerLM
from lmforge.utils.config import load_config
from lmforge.vision._train import phase_train_config, run_phase
from lmforge.vision.data import WordTokenizer
from lmforge.vision.scenes import ProceduralScenes, Scene, SceneObject, vocabulary
from lmforge.vision.vq_train import (
    ImageTokenLMObjective,
    TokenLayout,
    VQObjective,
    VQRunConfig,
    caption_codes,
    evaluate_vq,
    generate_codes,
    interleave,
    parse_caption,
    run_vq,
    score_captions,
)
from lmforge.vision.vqvae import VQVAE, CodebookUpdate, EMACodebook, VQConfig


def test_codebook_nearest_straight_through_and_ema_reference() -> None:
    torch.manual_seed(0)
    cb = EMACodebook(6, 3, decay=0.9, restart_below=0.0)
    cb.initialized.fill_(1.0)  # keep the random codes (no data init) to test the EMA step alone
    z = torch.randn(2, 3, 2, 2, requires_grad=True)
    flat = z.detach().permute(0, 2, 3, 1).reshape(-1, 3)
    embed0, size0, sum0 = cb.embed.clone(), cb.cluster_size.clone(), cb.embed_sum.clone()
    zq, codes, commit, ppl = cb(z)
    # the forward only records the assignment: the EMA step waits for update()
    assert torch.equal(cb.embed, embed0) and len(cb.pending) == 1
    cb.update()
    assert cb.pending == []
    # nearest code by brute force
    ref_idx = torch.stack([((embed0 - v) ** 2).sum(1).argmin() for v in flat])
    assert torch.equal(codes.flatten(), ref_idx)
    # straight-through: forward is the code, backward the identity
    torch.testing.assert_close(zq.detach().permute(0, 2, 3, 1).reshape(-1, 3), embed0[ref_idx])
    zq.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones_like(z))
    torch.testing.assert_close(commit, F.mse_loss(flat, embed0[ref_idx]))
    # EMA by hand
    counts = torch.bincount(ref_idx, minlength=6).float()
    sums = torch.zeros(6, 3).index_add_(0, ref_idx, flat)
    size = 0.9 * size0 + 0.1 * counts
    total = size.sum()
    smoothed = (size + 1e-5) / (total + 6e-5) * total
    torch.testing.assert_close(cb.embed, (0.9 * sum0 + 0.1 * sums) / smoothed[:, None])
    p = counts / counts.sum()
    torch.testing.assert_close(ppl, torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))


def test_dead_codes_restart_at_encoder_outputs() -> None:
    torch.manual_seed(0)
    cb = EMACodebook(4, 2, decay=0.5, restart_below=0.9)
    cb.initialized.fill_(1.0)
    z = torch.full((1, 2, 2, 2), 5.0)
    cb(z)
    cb.update()
    assert (cb.embed == 5.0).all(dim=1).sum() >= 3  # unused codes moved onto the data


def test_codebook_update_runs_after_the_step_and_skips_with_it() -> None:
    # CodebookUpdate, the Trainer callback: one EMA step over all micro-batches of the step
    # (as if they were one batch), nothing when the step was skipped
    torch.manual_seed(0)
    vq = VQVAE(VQConfig(channels=8, code_dim=4, codebook_size=8, restart_below=0.0))
    vq.codebook.initialized.fill_(1.0)  # no data init: both see the same codes
    twin = VQVAE(VQConfig(channels=8, code_dim=4, codebook_size=8, restart_below=0.0))
    twin.load_state_dict(vq.state_dict())
    images = torch.randn(4, 3, 16, 16)
    vq(images[:2]), vq(images[2:])
    CodebookUpdate(vq)(None, 1, {"skipped": False})
    twin(images)
    twin.codebook.update()
    torch.testing.assert_close(vq.codebook.embed, twin.codebook.embed)
    before = vq.codebook.embed.clone()
    vq(images)
    CodebookUpdate(vq)(None, 2, {"skipped": True})
    assert torch.equal(vq.codebook.embed, before) and vq.codebook.pending == []


def test_codes_start_at_the_first_batch() -> None:
    torch.manual_seed(0)
    cb = EMACodebook(8, 2, decay=0.99)
    z = torch.randn(4, 2, 3, 3) * 50 + 100  # far from the random init's scale
    _, codes, _, ppl = cb(z)
    assert ppl > 2.0 and codes.unique().numel() > 2


def test_vq_objective_learns_in_the_trainer(tmp_path) -> None:
    torch.manual_seed(0)
    scenes = ProceduralScenes(image_size=16)
    vq = VQVAE(VQConfig(channels=16, code_dim=8, codebook_size=16))
    obj = VQObjective(scenes, 8)
    tc = phase_train_config(tmp_path, steps=25, lr=3e-3, warmup=0, batch_size=8, device="cpu",
                            seed=0)  # fmt: skip
    logs: list[dict] = []
    run_phase(obj, vq, tc, logs.append, [CodebookUpdate(vq)])
    losses = [r["loss"] for r in logs]
    assert len(losses) == 25 and sum(losses[-5:]) < 0.6 * sum(losses[:5])
    assert logs[-1]["perplexity"] >= 1.0 and vq.codebook.pending == []
    batch = obj.next_batch()
    assert vq.encode(batch).shape == (8, 2, 2) and vq.decode(vq.encode(batch)).shape == batch.shape
    res = evaluate_vq(vq, scenes, 8)
    assert 0 < res["recon_mse"] < 1 and 1 <= res["perplexity"] <= 16


def test_interleaved_sequences_and_decoding() -> None:
    tok = WordTokenizer(vocabulary())
    layout = TokenLayout(tok.vocab_size, 16)
    codes = torch.tensor([[3, 0], [15, 7]])
    gen = interleave(tok, layout, "one object", codes, generate=True)
    assert gen == [
        tok.bos_id,
        *tok.encode("one object"),
        layout.boi,
        *(layout.first_code + torch.tensor([3, 0, 15, 7])).tolist(),
        layout.eoi,
        tok.eos_id,
    ]
    cap = interleave(tok, layout, "one object", codes, generate=False)
    assert cap[1] == layout.boi and cap[-3:] == [*tok.encode("one object"), tok.eos_id][-3:]

    torch.manual_seed(0)
    scenes = ProceduralScenes(image_size=16)
    vq = VQVAE(VQConfig(channels=16, code_dim=8, codebook_size=16))
    lm = TransformerLM(
        ModelConfig(
            vocab_size=layout.vocab_size,
            context_length=64,
            d_model=32,
            n_layers=1,
            n_heads=2,
            qk_norm=True,
        )
    )
    obj = ImageTokenLMObjective(scenes, vq, tok, 4, z_loss=1e-4)
    x, y = obj.next_batch()
    loss, n = obj.loss(lm, (x, y))
    assert n == (y != -100).sum() and torch.isfinite(loss)
    said = caption_codes(lm, tok, layout, codes[None], max_words=5)
    assert len(said) == 1 and all(w in tok.stoi for w in said[0].split())
    sampled = generate_codes(lm, tok, layout, "one object", 2, 2, torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 2, 2) and sampled.min() >= 0 and sampled.max() < 16


def test_run_vq_writes_pngs_and_results(tmp_path) -> None:
    cfg = load_config(
        VQRunConfig,
        None,
        [
            "vq.channels=8",
            "vq.code_dim=4",
            "vq.codebook_size=8",
            "vq_train.steps=3",
            "vq_train.batch_size=4",
            "vq_train.warmup=1",
            "lm.d_model=16",
            "lm.n_layers=1",
            "lm.n_heads=2",
            "lm_train.steps=2",
            "lm_train.batch_size=4",
            "lm_train.warmup=1",
            "run.image_size=16",
            "run.eval_images=4",
            "run.samples=2",
            f"run.out={tmp_path}",
        ],
    )
    res = run_vq(cfg, log=lambda r: None)
    for prefix in ("caption_", "baseline_", "gen_caption_"):
        for attr in ("count", "position", "kind", "name", "color", "size", "exact"):
            assert 0.0 <= res[prefix + attr] <= 1.0
    assert {"recon_mse", "perplexity", "codes_used", "gen_reencode_same_codes"} <= set(res)
    assert res["codebook_size"] == 8 and 1 <= res["codes_used"] <= 8
    for name in ("recon.png", "samples.png", "results.json", "config.toml", "vq/metrics.jsonl",
                 "lm/metrics.jsonl", "vq/loss_curve.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "recon.png").read_bytes()[:4] == b"\x89PNG"


def test_captions_parse_back_to_their_scene_graphs() -> None:
    val = ProceduralScenes(0, "val", image_size=16, max_objects=3)
    scenes = [val[i].scene for i in range(40)]
    for sc in scenes:
        count, objects = parse_caption(sc.caption())
        assert count == len(sc.objects)
        assert objects == {
            (o.row, o.col): {"kind": o.kind, "name": o.name, "color": o.color, "size": o.size}
            for o in sc.objects
        }
    assert set(score_captions([s.caption() for s in scenes], scenes).values()) == {1.0}


def test_score_captions_counts_each_attribute_per_object() -> None:
    scene = Scene(
        (
            SceneObject("circle", "red", "small", 0, 0),
            SceneObject("digit", "blue", "large", 1, 2, glyph="7"),
        )
    )
    # right count; circle right but large; digit at its cell with the wrong glyph; an extra
    # object at an empty cell (costs nothing per object, the count still counts it as said)
    said = (
        "two objects : a large red circle at the top left and a large blue digit 1 at the "
        "middle right and a small green square at the bottom left ."
    )
    assert score_captions([said], [scene]) == {
        "count": 1.0,
        "position": 1.0,
        "kind": 1.0,
        "name": 0.5,
        "color": 1.0,
        "size": 0.5,
        "exact": 0.0,
    }
    # wrong count, the digit misplaced, garbage after it: only the circle's cell is found
    said = "three objects : a small red square at the top left and a blue digit 7 at the top"
    got = score_captions([said, "letter letter . :"], [scene, scene])
    assert got == {
        "count": 0.0,
        "position": 0.25,
        "kind": 0.0,
        "name": 0.0,
        "color": 0.25,
        "size": 0.25,
        "exact": 0.0,
    }
