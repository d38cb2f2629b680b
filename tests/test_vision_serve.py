"""Serving a VLM, the image side (lmforge.vision.serving): untrusted image bytes and data URLs,
the training preprocessing and pixel hash, placeholder expansion + embeddings, the loader."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import WordTokenizer, preprocess
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.serving import (
    VLM_CHAT_TEMPLATE,
    VisionTower,
    VLMTokenizer,
    decode_data_url,
    decode_image,
    image_pixels,
    is_vlm_folder,
    load_vlm,
    prepare_image_prompt,
)
from lmforge.vision.vlm import VisionLanguageModel

TOK = WordTokenizer(vocabulary())
VIT = ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2)


def _vlm(seed: int = 0) -> VisionLanguageModel:
    torch.manual_seed(seed)
    lm = TransformerLM(
        ModelConfig(vocab_size=TOK.vocab_size, context_length=96, d_model=32, n_layers=2, n_heads=2)
    )
    return VisionLanguageModel(ViT(VIT), lm, TOK.image_id).eval()


def _png(array: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def _scene(i: int = 0, size: int = 24) -> np.ndarray:
    return np.asarray(ProceduralScenes(seed=3, image_size=size)[i].image)


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_data_url_round_trip_and_refusals() -> None:
    png = _png(_scene())
    assert decode_data_url(_url(png)) == png
    assert decode_data_url(_url(png, "image/jpeg;charset=x")) == png  # parameters are allowed
    assert decode_data_url(f"data:;base64,{base64.b64encode(png).decode()}") == png
    for url, match in [
        ("https://example.com/cat.png", "'https' URLs are not fetched"),
        ("file:///etc/passwd", "'file' URLs are not fetched"),
        ("data:image/png,rawbytes", "base64 data URL"),
        (_url(png, "text/plain"), "MIME type 'text/plain'"),
        ("data:image/png;base64,@@@not base64@@@", "does not decode"),
        ("data:image/png;base64,abc", "does not decode"),  # bad padding
        ("data:image/png;base64,", "empty"),
    ]:
        with pytest.raises(LmforgeError, match=match):
            decode_data_url(url)
    # the byte limit is judged from the base64's length, before anything is decoded
    with pytest.raises(LmforgeError, match="exceeds the limit of 100"):
        decode_data_url(_url(b"x" * 1000), max_bytes=100)
    with pytest.raises(LmforgeError, match="must be a string"):
        decode_data_url(None)  # type: ignore[arg-type]


def test_decode_image_refuses_bad_and_huge_images() -> None:
    from PIL import Image

    img = decode_image(_png(_scene()))
    assert img.mode == "RGB" and img.size == (24, 24)
    png = _png(_scene())
    for data, match in [
        (b"not an image at all", "image: not a readable image"),
        (png[: len(png) // 2], "not a readable image"),  # truncated: fails when pixels load
        (b"", "not a readable image"),
    ]:
        with pytest.raises(LmforgeError, match=match):
            decode_image(data)
    with pytest.raises(LmforgeError, match="bytes exceeds the image limit of 10"):
        decode_image(png, max_bytes=10)
    # a 5000x5000 1-bit PNG is a few KB on the wire but 25M pixels: refused from its header
    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(LmforgeError, match="5000x5000 = 25000000 pixels exceeds the limit"):
        decode_image(buf.getvalue(), "huge.png")


def test_pixels_are_the_training_preprocessing_and_the_digest_names_the_pixels() -> None:
    scene = _scene(size=40)
    px, digest = image_pixels(decode_image(_png(scene)), 24)
    torch.testing.assert_close(px, preprocess(scene, 24), rtol=0, atol=0)
    # the same pixels in another lossless file format: the same digest
    assert image_pixels(decode_image(_png(scene, "BMP")), 24)[1] == digest
    assert image_pixels(scene, 24)[1] == digest
    assert image_pixels(np.ascontiguousarray(scene[::-1]), 24)[1] != digest
    # a crop that preprocesses differently is another image, and so is a change of size
    assert image_pixels(np.ascontiguousarray(scene[:, :39]), 24)[1] != digest
    with pytest.raises(LmforgeError, match=r"\(H, W, 3\) uint8"):
        image_pixels(scene.astype(np.float32), 24)


def test_prepare_expands_placeholders_and_matches_the_training_forward() -> None:
    vlm = _vlm().double()
    tower = VisionTower.from_vlm(vlm)
    n = tower.n_image_tokens
    assert (tower.image_size, n) == (24, 9)
    a, b = _scene(0), _scene(1)
    prompt = [TOK.bos_id, TOK.image_id, 10, TOK.image_id, 11, 12]
    out = prepare_image_prompt(tower, prompt, [_png(a), b])
    assert out.token_ids == [TOK.bos_id] + [TOK.image_id] * n + [10] + [TOK.image_id] * n + [11, 12]
    assert out.spans == [(1, n), (2 + n, n)]
    assert out.digests == [image_pixels(a, 24)[1], image_pixels(b, 24)[1]]
    assert out.slot_keys() == {
        **{p: out.digests[0] for p in range(1, 1 + n)},
        **{p: out.digests[1] for p in range(2 + n, 2 + 2 * n)},
    }
    assert out.embeds.shape == (2 * n, 32) and out.embeds.dtype == torch.float64
    # the embeddings spliced through the LM's input_embeds are the VLM's own training forward
    pixels = torch.stack([preprocess(a, 24), preprocess(b, 24)]).double()
    ids = torch.tensor([out.token_ids])
    ref = vlm(ids, pixels)  # (1, T, V)
    x = vlm.lm.token_embeddings(ids).clone()
    for k, (s, m) in enumerate(out.spans):
        x[0, s : s + m] = out.embeds[k * n : (k + 1) * n]
    torch.testing.assert_close(vlm.lm(ids, input_embeds=x), ref)
    # precomputed pixels (another process did the decoding) give the same embeddings
    again = prepare_image_prompt(
        tower, prompt, [], pixels=[image_pixels(a, 24), image_pixels(b, 24)]
    )
    torch.testing.assert_close(again.embeds, out.embeds)
    # no images: the prompt unchanged, no embeddings
    plain = prepare_image_prompt(tower, [TOK.bos_id, 10], [])
    assert plain.token_ids == [TOK.bos_id, 10] and plain.embeds.shape == (0, 32)


def test_an_image_seen_lately_takes_its_cached_rows_without_a_forward() -> None:
    tower = VisionTower.from_vlm(_vlm().double())
    tower.cache_images = 2
    calls: list[int] = []
    tower.vision.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    (pa, da), (pb, db), (pc, dc) = (image_pixels(_scene(i), 24) for i in range(3))
    want = tower.embed_rows([pa, pb])  # no digests: every image through the forward
    assert calls == [2]
    first = tower.embed_rows([pa, pb], [da, db])
    torch.testing.assert_close(first, want)
    assert calls == [2, 2]
    # both seen: no forward, the same rows; a new one with an old one: a forward of one image
    torch.testing.assert_close(
        tower.embed_rows([pb, pa], [db, da]), torch.cat([want[9:], want[:9]])
    )
    assert calls == [2, 2]
    mixed = tower.embed_rows([pc, pa], [dc, da])
    assert calls == [2, 2, 1]
    torch.testing.assert_close(mixed[9:], want[:9])
    torch.testing.assert_close(mixed[:9], tower.embed_rows([pc]))
    # bounded at cache_images, least recently used out first: b went, a and c stay
    tower.embed_rows([pa, pc], [da, dc])
    assert calls == [2, 2, 1, 1]
    tower.embed_rows([pb], [db])
    assert calls == [2, 2, 1, 1, 1]
    tower.clear_cache()
    tower.embed_rows([pa], [da])
    assert calls == [2, 2, 1, 1, 1, 1]


def test_prepare_refuses_mismatched_and_bad_inputs() -> None:
    tower = VisionTower.from_vlm(_vlm())
    with pytest.raises(LmforgeError, match=r"1 <image> placeholder.* but 2 image"):
        prepare_image_prompt(tower, [TOK.bos_id, TOK.image_id], [_scene(0), _scene(1)])
    with pytest.raises(LmforgeError, match=r"0 <image> placeholder.* but 1 image"):
        prepare_image_prompt(tower, [TOK.bos_id, 10], [_scene(0)])
    with pytest.raises(LmforgeError, match="image 1: not a readable image"):
        prepare_image_prompt(tower, [TOK.image_id], [b"garbage"])
    with pytest.raises(LmforgeError, match=r"expected \(3, 24, 24\)"):
        prepare_image_prompt(tower, [TOK.image_id], [], pixels=[(torch.zeros(3, 8, 8), "d")])


def test_tokenizer_and_template_give_the_training_format() -> None:
    from lmforge.serve.templates import render_template

    tok = VLMTokenizer(TOK)
    text = render_template(
        VLM_CHAT_TEMPLATE, [{"role": "user", "content": "<image> how many shapes are there ?"}]
    )
    ids = tok.encode(text)
    assert ids[:2] == [TOK.bos_id, TOK.image_id]
    assert ids[2:] == TOK.encode("how many shapes are there ?")
    assert tok.eot_id == TOK.eos_id and tok.vocab_size == TOK.vocab_size
    assert tok.decode([TOK.bos_id, *TOK.encode("two red"), TOK.eos_id]) == "two red"


def test_load_vlm_refuses_what_is_not_a_vlm_folder(tmp_path) -> None:
    assert not is_vlm_folder(tmp_path)
    with pytest.raises(LmforgeError, match="VLM folder not found"):
        load_vlm(tmp_path / "missing")
    with pytest.raises(LmforgeError, match=r"no config\.toml"):
        load_vlm(tmp_path)
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "stage2").mkdir()
    assert is_vlm_folder(tmp_path)  # an older run: load_vlm says how to add what it lacks
    with pytest.raises(LmforgeError, match=r"no vision\.toml.*run the same `lmforge vision vlm`"):
        load_vlm(tmp_path)
    for name in ("config.toml", "vision.toml"):
        (tmp_path / name).write_text("")
    TOK.save(tmp_path / "vocab.json")
    with pytest.raises(LmforgeError, match="no stage2/ or stage1/ checkpoint"):
        load_vlm(tmp_path)
