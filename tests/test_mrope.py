"""MRoPE (Qwen2-VL's multimodal RoPE): equal components are exactly 1D RoPE, a hand-computed
rotation on a tiny image grid, Qwen2-VL's position rule, gradients, the VLM and the engine."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.layers import RotaryEmbedding
from lmforge.utils.config import load_config
from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import WordTokenizer
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.mrope import image_spans, mrope_positions, mrope_positions_batch
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.vlm import VisionLanguageModel, VLMObjective, splice_image_embeds

TOK = WordTokenizer(vocabulary())
VIT = ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2)  # 3x3 grid


def _lm_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=TOK.vocab_size, context_length=64, d_model=48, n_layers=2, n_heads=4)
    return ModelConfig(**{**base, **kw})  # head_dim 12: E/2 = 6


def test_equal_components_are_exactly_1d_rope() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(10000.0, 12, 32, mrope_sections=(2, 2, 2))
    x = torch.randn(2, 3, 7, 12)  # (B, H, T, E)
    pos = torch.randint(0, 32, (2, 1, 7))  # (B, 1, T)
    assert torch.equal(rope.rotate_3d(x, pos.expand(3, -1, -1, -1)), rope(x, pos))
    # and the whole model: text-only 3-vector positions give the 1D model's logits, bit for bit
    torch.manual_seed(1)
    lm = TransformerLM(_lm_cfg(mrope_sections=(2, 2, 2), attention="reference")).double()
    ref = TransformerLM(_lm_cfg(attention="reference")).double()
    ref.load_state_dict(lm.state_dict())
    idx = torch.randint(0, TOK.vocab_size, (2, 9))
    p1 = torch.arange(9).expand(2, 9)  # (B, T)
    want = ref(idx)
    assert torch.equal(lm(idx), want)
    assert torch.equal(lm(idx, p1.expand(3, 2, 9)), want)  # (3, B, T)
    assert torch.equal(lm(idx, p1[..., None].expand(2, 9, 3)), want)  # (B, T, 3)


def test_mrope_positions_follow_qwen2_vl() -> None:
    # <bos> a [2x3 image] b c [2x2 image] d
    ids = [1, 5, *[4] * 6, 6, 7, *[4] * 4, 8]
    spans = [(2, 6), (10, 4)]
    assert image_spans(ids[:9], 4, 6) == [(2, 6)]
    pos = mrope_positions(ids, spans, [(2, 3), (2, 2)])
    t = [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 7, 7, 7, 9]
    h = [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 7, 8, 8, 9]
    w = [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9]
    assert pos.tolist() == [t, h, w]
    # text only: 0..T-1 in every component; a batch finds its images itself
    assert torch.equal(mrope_positions(torch.zeros(5), [], (3, 3)), torch.arange(5).expand(3, 5))
    batch = mrope_positions_batch(torch.tensor([ids[:9], [1, 5, 6, 7, 8, 9, 9, 9, 9]]), 4, (2, 3))
    assert batch.shape == (3, 2, 9) and batch[:, 0].tolist() == [r[:9] for r in (t, h, w)]
    assert torch.equal(batch[:, 1], torch.arange(9).expand(3, 9))
    with pytest.raises(ValueError, match="does not fit"):
        mrope_positions(ids, [(12, 6)], (2, 3))
    with pytest.raises(ValueError, match="not a multiple of 6"):
        image_spans([1, 4, 4, 2], 4, 6)


def test_hand_computed_rotation_on_a_tiny_grid() -> None:
    torch.manual_seed(2)
    e, sections, theta = 8, (1, 2, 1), 100.0
    rope = RotaryEmbedding(theta, e, 16, mrope_sections=sections)
    pos = mrope_positions([0] * 6, [(1, 4)], (2, 2))  # text, 2x2 image, text
    assert pos.tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    x = torch.randn(6, e, dtype=torch.float64)
    got = rope.rotate_3d(x, pos)
    component = [0, 1, 1, 2]  # frequency i turns with this component (sections 1, 2, 1)
    for t in range(6):
        for i in range(e // 2):
            angle = float(pos[component[i], t]) * theta ** (-2 * i / e)
            c, s = math.cos(angle), math.sin(angle)
            a, b = float(x[t, 2 * i]), float(x[t, 2 * i + 1])
            # the tables are fp32: agreement to fp32 rounding
            assert got[t, 2 * i].item() == pytest.approx(a * c - b * s, abs=1e-6)
            assert got[t, 2 * i + 1].item() == pytest.approx(b * c + a * s, abs=1e-6)


def test_gradients_flow_through_mrope() -> None:
    torch.manual_seed(3)
    lm = TransformerLM(_lm_cfg(mrope_sections=(2, 2, 2)))
    ids = torch.tensor([[1, 5, *[4] * 9, 6, 7]])
    pos = mrope_positions_batch(ids, 4, (3, 3))
    logits = lm(ids, pos)
    assert not torch.equal(logits, lm(ids))  # the image's 2D positions matter
    logits.logsumexp(-1).sum().backward()
    for name, p in lm.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert lm.layers[0].attn.q_proj.weight.grad.abs().sum() > 0
    x = torch.randn(3, 13, 12, requires_grad=True)
    lm.layers[0].attn.rope.rotate_3d(x, pos).square().sum().backward()
    # a rotation keeps norms: d/dx |Rx|² = 2x
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_config_rejects_bad_sections_in_one_line() -> None:
    for bad, what in (("[2,2,1]", "summing to head_dim / 2 = 6"), ("[6]", "3 non-negative")):
        with pytest.raises(LmforgeError, match=what) as err:
            load_config(ModelConfig, None, ["d_model=48", "n_heads=4", f"mrope_sections={bad}"])
        assert "\n" not in str(err.value)
    with pytest.raises(LmforgeError, match="attention_type = gqa"):
        load_config(ModelConfig, None, ["mrope_sections=[16,8,8]", "attention_type=mla"])
    cfg = load_config(ModelConfig, None, ["d_model=48", "n_heads=4", "mrope_sections=[2,2,2]"])
    assert cfg.mrope_sections == (2, 2, 2)
    with pytest.raises(ValueError, match="need MRoPE"):
        TransformerLM(_lm_cfg())(torch.zeros(1, 4, dtype=torch.long), torch.zeros(3, 1, 4).long())


def _vlm(mrope: bool, seed: int = 0) -> VisionLanguageModel:
    torch.manual_seed(seed)
    lm = TransformerLM(_lm_cfg(mrope_sections=(2, 2, 2) if mrope else ()))
    return VisionLanguageModel(ViT(VIT), lm, TOK.image_id)


def test_vlm_passes_grid_positions_and_trains() -> None:
    model = _vlm(mrope=True).double()
    n = model.n_image_tokens
    tokens = torch.tensor([[TOK.bos_id, 10, *[TOK.image_id] * n, 11, 12]] * 2)
    images = torch.randn(2, 3, 24, 24, dtype=torch.float64)
    embeds = splice_image_embeds(
        model.lm.token_embeddings(tokens), tokens, model.image_embeds(images), TOK.image_id
    )
    pos = mrope_positions(tokens[0], [(2, n)], model.grid_hw)  # (3, T)
    assert pos[:, -1].tolist() == [6, 6, 6]  # after the 3x3 grid at t0 = 2: 2 + 3, then + 1
    want = model.lm(tokens, pos[:, None].expand(3, 2, -1), input_embeds=embeds)
    torch.testing.assert_close(model(tokens, images), want, rtol=0, atol=0)
    assert not torch.allclose(model(tokens, images), model.lm(tokens, input_embeds=embeds))

    # stage 2 (ViT frozen) on the objective: the loss falls with MRoPE on
    model = _vlm(mrope=True)
    model.vision.requires_grad_(False)
    scenes = ProceduralScenes(seed=1, image_size=24, max_objects=2)
    obj = VLMObjective(scenes, TOK, n, 8, "image", "answer")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batch = obj.next_batch()
    losses = []
    for _ in range(15):
        total, weight = obj.loss(model, batch)
        opt.zero_grad()
        (total / weight).backward()
        opt.step()
        losses.append((total / weight).item())
    assert losses[-1] < 0.5 * losses[0]


def _spliced(vlm: VisionLanguageModel, x: torch.Tensor, prompt) -> torch.Tensor:
    """The LM's input embeddings (1, T, D) of ``x`` with the prompt's image spans' rows (a
    generated token equal to the image id stays a token)."""
    embeds = vlm.lm.token_embeddings(x).clone()  # (1, T, D)
    first = 0
    for s, n in prompt.spans:
        embeds[0, s : s + n] = prompt.embeds[first : first + n]
        first += n
    return embeds


@torch.no_grad()
def _reference(vlm: VisionLanguageModel, prompt, n_tokens: int) -> list[int]:
    """Greedy tokens by full recompute: splice the image rows, MRoPE grid positions, no cache."""
    ids, out = list(prompt.token_ids), []
    for _ in range(n_tokens):
        x = torch.tensor([ids])
        embeds = _spliced(vlm, x, prompt)
        pos = mrope_positions(ids, prompt.spans, (3, 3))[:, None]  # (3, 1, T)
        ids.append(int(vlm.lm(x, pos, input_embeds=embeds)[0, -1].argmax()))
        out.append(ids[-1])
    return out


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(block_size=8, num_blocks=32),  # one prefill step
        dict(block_size=4, num_blocks=32, max_num_batched_tokens=4),  # 4-token chunks cut images
        dict(block_size=4, num_blocks=12, max_num_batched_tokens=8),  # + preemption by recompute
    ],
)
def test_engine_greedy_with_images_equals_mrope_reference(engine_kw: dict) -> None:
    from lmforge.serve import Engine, SamplingParams
    from lmforge.vision.serving import VisionTower, prepare_image_prompt

    vlm = _vlm(mrope=True, seed=4).eval()
    scenes = ProceduralScenes(seed=5, image_size=24)
    a, b, c = (scenes[i].image.__array__() for i in range(3))
    tower = VisionTower.from_vlm(vlm)
    i = TOK.image_id
    prompts = [
        prepare_image_prompt(tower, [TOK.bos_id, 10, i, 11, 12], [a]),
        prepare_image_prompt(tower, [TOK.bos_id, 10, i, i, 11], [b, c]),  # two images
        [TOK.bos_id, 13, 14, 15],  # text only, in the same steps
    ]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [_reference(vlm, p, 8) for p in prompts[:2]]
    engine = Engine(vlm.lm, **engine_kw)
    ids = [engine.add_request(p.token_ids, greedy, image_embeds=p) for p in prompts[:2]]
    ids.append(engine.add_request(prompts[2], greedy))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    got = [done[r].outputs[0].token_ids for r in ids]
    assert got[:2] == want
    # the text-only request: MRoPE on text is 1D RoPE, the plain engine's answer
    assert (
        got[2]
        == Engine(vlm.lm, block_size=8).generate([prompts[2]], greedy)[0].outputs[0].token_ids
    )
    # the grid positions matter: 1D positions on the same spliced prompt decode otherwise
    x = torch.tensor([prompts[1].token_ids])
    with torch.no_grad():
        embeds = _spliced(vlm, x, prompts[1])
        pos = mrope_positions(prompts[1].token_ids, prompts[1].spans, (3, 3))[:, None]
        assert not torch.allclose(
            vlm.lm(x, pos, input_embeds=embeds), vlm.lm(x, input_embeds=embeds)
        )


def test_engine_step_positions_shift_text_after_images() -> None:
    from lmforge.vision.mrope import engine_step_positions

    # sequence 1: decode at index 14 after a 3x3 image at 2 (slots 2..10): 14 - 9 + 3 = 8
    # sequence 2: text only; sequence 3: a prefill chunk [0, 4) cutting a 2x2 image at 1
    flat, grid = engine_step_positions([([(2, 9)], 14, 1), (None, 5, 2), ([(1, 4)], 0, 4)])
    assert flat == [8, 5, 6, 0, 1, 1, 1]
    assert grid == [[8, 5, 6, 0, 1, 1, 1], [8, 5, 6, 0, 1, 1, 2], [8, 5, 6, 0, 1, 2, 1]]
    assert engine_step_positions([([(2, 9)], 14, 1)]) == ([8], None)  # no image row: scalars
    with pytest.raises(ValueError, match="square"):
        engine_step_positions([([(0, 6)], 0, 6)])


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_decoding_with_mrope_images_is_exact(draft: str) -> None:
    """Drafts only propose (a draft model's own steps use 1D positions: fewer acceptances at
    worst); the verify step is the target's MRoPE step, so greedy output is the reference's."""
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.speculative import DraftModel, NgramDraft, truncated_draft
    from lmforge.vision.serving import VisionTower, prepare_image_prompt

    vlm = _vlm(mrope=True, seed=4).eval()
    image = ProceduralScenes(seed=5, image_size=24)[0].image.__array__()
    ids = [TOK.bos_id, 10, TOK.image_id, 11, 10, 11]
    p = prepare_image_prompt(VisionTower.from_vlm(vlm), ids, [image])
    proposer = NgramDraft() if draft == "ngram" else DraftModel(truncated_draft(vlm.lm, 1))
    engine = Engine(vlm.lm, block_size=4, num_blocks=32, speculative=proposer)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rid = engine.add_request(p.token_ids, greedy, image_embeds=p)
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    assert out.outputs[0].token_ids == _reference(vlm, p, 12)
    assert engine.speculative.stats.drafted > 0


def test_mtp_drafts_with_mrope_images_are_refused_in_one_line() -> None:
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.speculative import mtp_draft_for
    from lmforge.vision.serving import VisionTower, prepare_image_prompt

    torch.manual_seed(0)
    lm = TransformerLM(_lm_cfg(mrope_sections=(2, 2, 2), mtp_depth=1))
    vlm = VisionLanguageModel(ViT(VIT), lm, TOK.image_id).eval()
    image = ProceduralScenes(seed=5, image_size=24)[0].image.__array__()
    p = prepare_image_prompt(VisionTower.from_vlm(vlm), [TOK.bos_id, TOK.image_id, 10], [image])
    engine = Engine(lm, block_size=4, num_blocks=32, speculative=mtp_draft_for(lm))
    with pytest.raises(LmforgeError, match="MTP drafts") as err:
        engine.add_request(p.token_ids, SamplingParams(max_tokens=2), image_embeds=p)
    assert "\n" not in str(err.value)
