"""Prompts with images on the engine: greedy output equals the VLM's own full-recompute forward
(with chunked prefill cutting the image slots, preemption, n > 1), and the prefix cache keys
image slots by their pixels (same tokens + another image never shares KV)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import WordTokenizer
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.serving import VisionTower, prepare_image_prompt
from lmforge.vision.vlm import VisionLanguageModel, splice_image_embeds

TOK = WordTokenizer(vocabulary())
N = 9  # image slots: (24 / 8)^2 patches
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _vlm(seed: int = 0) -> VisionLanguageModel:
    torch.manual_seed(seed)
    lm_cfg = ModelConfig(vocab_size=TOK.vocab_size, context_length=64, d_model=32, n_layers=2,
                         n_heads=4, n_kv_heads=2)  # fmt: skip
    vit = ViT(ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2))
    return VisionLanguageModel(vit, TransformerLM(lm_cfg), TOK.image_id).eval()


def _images(k: int = 3) -> list[np.ndarray]:
    scenes = ProceduralScenes(seed=5, image_size=24)
    return [np.asarray(scenes[i].image) for i in range(k)]


@torch.no_grad()
def _reference(vlm: VisionLanguageModel, prompt, n_tokens: int) -> list[int]:
    """Greedy tokens by full recompute: the LM's forward on the prompt with the image slots'
    embeddings spliced in (training's splice), no cache."""
    ids = list(prompt.token_ids)
    rows = prompt.embeds.view(-1, N, prompt.embeds.shape[-1])  # (M, N, D)
    out = []
    for _ in range(n_tokens):
        x = torch.tensor([ids])
        embeds = splice_image_embeds(vlm.lm.token_embeddings(x), x, rows, TOK.image_id)
        nxt = int(vlm.lm(x, input_embeds=embeds)[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def _prompt(vlm, images, text=(10, 11, 12)):
    ids = [TOK.bos_id, *text[:1], *[TOK.image_id] * len(images), *text[1:]]
    return prepare_image_prompt(VisionTower.from_vlm(vlm), ids, images)


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(block_size=8, num_blocks=32),  # one prefill step
        dict(block_size=4, num_blocks=32, max_num_batched_tokens=4),  # 4-token chunks cut images
        dict(block_size=4, num_blocks=12, max_num_batched_tokens=8),  # + preemption by recompute
    ],
)
def test_greedy_with_images_equals_full_recompute(engine_kw: dict) -> None:
    vlm = _vlm()
    a, b, c = _images()
    prompts = [_prompt(vlm, [a]), _prompt(vlm, [b, c]), _prompt(vlm, [c], text=(13, 14, 15, 16))]
    assert prompts[1].spans == [(2, N), (2 + N, N)]  # the 4-token chunks split both images
    want = [_reference(vlm, p, 8) for p in prompts]
    engine = Engine(vlm.lm, **engine_kw)
    ids = [engine.add_request(p.token_ids, GREEDY, image_embeds=p) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in ids] == want
    # the images matter: the same tokens with the placeholders' own embeddings differ
    plain = Engine(vlm.lm, block_size=8).generate([p.token_ids for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in plain] != want
    if engine_kw["num_blocks"] == 12:
        assert engine.stats["preemptions"] > 0


def test_prompt_ending_in_image_slots_and_n_samples() -> None:
    """The one token computed after a full prefix hit is an image slot (a 1-token step that
    must not take the decode fast path), and n > 1 samples share the image blocks."""
    vlm = _vlm()
    (a,) = _images(1)
    tower = VisionTower.from_vlm(vlm)
    p = prepare_image_prompt(tower, [TOK.bos_id, 10, 11, 12, TOK.image_id], [a])
    assert len(p.token_ids) == 13  # 3 full blocks of 4 before the last token, an image slot
    want = _reference(vlm, p, 8)
    engine = Engine(vlm.lm, block_size=4, num_blocks=32)
    seen, run = [], engine.runner.run

    def spy(batch):
        seen.append((batch.decode_only, batch.image_rows is not None))
        return run(batch)

    engine.runner.run = spy
    for _ in range(2):  # the second run hits every full block but the last token's
        rid = engine.add_request(p.token_ids, SamplingParams(temperature=0, max_tokens=8, n=2,
                                 ignore_eos=True), image_embeds=p)  # fmt: skip
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid and o.finished]
        assert [s.token_ids for s in outs[0].outputs] == [want, want]
    assert engine.allocator.hits > 0
    assert (True, True) in seen  # a one-token step of an image slot ran (eagerly, with it)


def test_prefix_cache_keys_hold_the_image() -> None:
    vlm = _vlm()
    a, b = _images(2)
    pa, pb = _prompt(vlm, [a], text=(10, 11, 12, 13)), _prompt(vlm, [b], text=(10, 11, 12, 13))
    assert pa.token_ids == pb.token_ids and pa.digests != pb.digests
    engine = Engine(vlm.lm, block_size=2, num_blocks=64)

    def run(p) -> tuple[list[int], int, list[float]]:
        before = engine.allocator.hits
        rid = engine.add_request(p.token_ids, GREEDY, image_embeds=p)
        out = None
        while engine.has_unfinished():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        return out.outputs[0].token_ids, engine.allocator.hits - before, out.outputs[0].logprobs

    got_a, hits, lp_a = run(pa)
    assert hits == 0 and got_a == _reference(vlm, pa, 8)
    # same tokens, another image: only the block before the first image slot is shared
    # ([bos, 10]); every block from the image on is computed again, with b's embeddings
    got_b, hits, lp_b = run(pb)
    assert hits == 1 and got_b == _reference(vlm, pb, 8)
    assert lp_a != lp_b  # (an untrained model may pick the same tokens; not with equal odds)
    # the same image again, decoded from another copy of the pixels: every full prompt block
    again = _prompt(vlm, [a.copy()], text=(10, 11, 12, 13))
    got, hits, lp = run(again)
    assert (
        got == got_a
        and lp == pytest.approx(lp_a, abs=1e-4)
        and hits == (len(again.token_ids) - 1) // 2
    )
    # a text-only prompt with the same ids shares nothing past [bos, 10] either
    got, hits, _ = run(type(pa)(pa.token_ids, pa.embeds[:0], [], []))
    assert hits == 1


def test_bad_image_embeds_are_one_line() -> None:
    vlm = _vlm()
    (a,) = _images(1)
    p = _prompt(vlm, [a])
    engine = Engine(vlm.lm, block_size=8, num_blocks=16)
    bad = [
        (type(p)(p.token_ids, p.embeds[:-1], p.spans, p.digests), "image embeddings"),
        (type(p)(p.token_ids, p.embeds, [(len(p.token_ids) - 2, N)], p.digests), "not inside"),
        (type(p)(p.token_ids, p.embeds, p.spans, []), "one digest per span"),
        (type(p)(p.token_ids, p.embeds[:, :8], p.spans, p.digests), "expected"),
    ]
    for images, match in bad:
        with pytest.raises(LmforgeError, match=match):
            engine.add_request(p.token_ids, GREEDY, image_embeds=images)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculative_decoding_with_an_image_prompt_is_exact(draft: str) -> None:
    """Prefill (with the image) is a plain step; the drafts only propose: greedy output is the
    full recompute's whatever the draft (the model's own first block sees no image)."""
    from lmforge.serve.speculative import DraftModel, NgramDraft, truncated_draft

    vlm = _vlm()
    (a,) = _images(1)
    p = _prompt(vlm, [a], text=(10, 11, 10, 11))
    proposer = NgramDraft() if draft == "ngram" else DraftModel(truncated_draft(vlm.lm, 1))
    engine = Engine(vlm.lm, block_size=4, num_blocks=32, speculative=proposer)
    rid = engine.add_request(p.token_ids, SamplingParams(temperature=0, max_tokens=12,
                             ignore_eos=True), image_embeds=p)  # fmt: skip
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    assert out.outputs[0].token_ids == _reference(vlm, p, 12)
    assert engine.speculative.stats.drafted > 0  # speculative steps did run
