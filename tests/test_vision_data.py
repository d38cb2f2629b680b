"""Procedural scenes, image/caption readers and CLIP preprocessing (lmforge.vision)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import (
    WordTokenizer,
    denormalize,
    encode_batch,
    iter_image_folder,
    iter_tar_shards,
    load_image,
    preprocess,
)
from lmforge.vision.scenes import ProceduralScenes, vocabulary


def test_scenes_deterministic_and_splits_differ() -> None:
    a, b = ProceduralScenes(seed=3), ProceduralScenes(seed=3)
    for i in (0, 7, 1000):
        assert np.array_equal(a[i].image, b[i].image) and a[i].caption == b[i].caption
    val = ProceduralScenes(seed=3, split="val")
    assert any(a[i].caption != val[i].caption for i in range(5))
    stream = a.stream(start=5)
    assert next(stream).caption == a[5].caption and next(stream).caption == a[6].caption


def test_scene_text_matches_graph_and_image() -> None:
    ds = ProceduralScenes(seed=0, image_size=48)
    words = set(vocabulary())
    kinds = set()
    for i in range(60):
        s = ds[i]
        assert s.image.shape == (48, 48, 3) and s.image.dtype == np.uint8
        n = len(s.scene.objects)
        count = next(q for q in s.qa if q.kind == "count")
        assert count.answer == ["zero", "one", "two", "three"][n]
        for obj in s.scene.objects:  # every object leaves its colour in its cell
            cell = s.image[obj.row * 16 : (obj.row + 1) * 16, obj.col * 16 : (obj.col + 1) * 16]
            assert (cell.reshape(-1, 3).astype(int).std(0) > 5).any()
        for q in s.qa:
            kinds.add(q.kind)
            assert (
                set(
                    WordTokenizer(vocabulary())
                    .decode(WordTokenizer(vocabulary()).encode(q.question + " " + q.answer))
                    .split()
                )
                <= words
            )
        assert all(w in words for w in s.caption.split())
    assert kinds == {"count", "color", "position", "digit"}


def test_preprocess_resizes_crops_and_normalizes() -> None:
    img = Image.fromarray(np.full((40, 80, 3), 128, np.uint8))
    x = preprocess(img, 32)
    assert x.shape == (3, 32, 32)
    back = denormalize(x)
    assert back.shape == (32, 32, 3) and np.abs(back.astype(int) - 128).max() <= 1
    same = ProceduralScenes()[0].image
    assert np.array_equal(denormalize(preprocess(same, 64)), same)


def _png(color=(10, 200, 30), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_folder_and_errors(tmp_path) -> None:
    (tmp_path / "a.png").write_bytes(_png())
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    lines = [{"image": "a.png", "caption": "a green thing"}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    [(img, cap)] = list(iter_image_folder(tmp_path / "c.jsonl"))
    assert img.size == (8, 6) and cap == "a green thing"

    def one_line_error(records: str, match: str) -> None:
        (tmp_path / "x.jsonl").write_text(records)
        with pytest.raises(LmforgeError, match=match) as e:
            list(iter_image_folder(tmp_path / "x.jsonl"))
        assert "\n" not in str(e.value)

    one_line_error('{"image": "bad.png", "caption": "x"}\n', "bad.png: not a readable image")
    one_line_error('{"image": "gone.png", "caption": "x"}\n', "image not found")
    one_line_error('{"image": "a.png"}\n', "x.jsonl:1: expected a string 'caption'")
    one_line_error('{"image": "a.png", "caption": "x"}\n{oops\n', "x.jsonl:2: not valid JSON")
    with pytest.raises(LmforgeError, match="exceeds the limit of 40"):
        load_image(tmp_path / "a.png", max_pixels=40)


def test_tar_shards(tmp_path) -> None:
    shard = tmp_path / "s-000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in [
            ("0001.png", _png((255, 0, 0))),
            ("0001.txt", b"red"),
            ("0002.png", _png((0, 0, 255))),
            ("0002.json", json.dumps({"caption": "blue"}).encode()),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pairs = list(iter_tar_shards([shard]))
    assert [c for _, c in pairs] == ["red", "blue"]
    assert pairs[0][0].getpixel((0, 0)) == (255, 0, 0)
    broken = tmp_path / "broken.tar"
    with tarfile.open(broken, "w") as tar:
        info = tarfile.TarInfo("0003.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"cap"))
    with pytest.raises(LmforgeError, match="0003: sample has no image member"):
        list(iter_tar_shards([broken]))
    (tmp_path / "junk.tar").write_bytes(b"\x00junk" * 10)
    with pytest.raises(LmforgeError, match=r"junk\.tar"):
        list(iter_tar_shards([tmp_path / "junk.tar"]))


def test_word_tokenizer_round_trip(tmp_path) -> None:
    tok = WordTokenizer(vocabulary())
    text = "two objects : a small red digit 7 at the top left and a large blue letter K at the middle center ."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<image> what")[0] == tok.image_id
    assert tok.encode("zebra") == [tok.unk_id]
    tok.save(tmp_path / "v.json")
    assert WordTokenizer.load(tmp_path / "v.json").itos == tok.itos
    ids = encode_batch(tok, [text, "one"], 8)
    assert ids.shape == (2, 8) and ids[0, -1] == tok.eos_id and ids[1, 2] == tok.eos_id
    assert (ids[1, 3:] == tok.pad_id).all() and ids.dtype == torch.long
    fitted = WordTokenizer.fit(["b b a", "c b"], max_size=7)
    assert fitted.itos[5:] == ["b", "a"]
