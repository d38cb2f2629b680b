"""Image–text data: user folders (images + JSONL captions), WebDataset-style tar shards, CLIP-style
preprocessing, a word tokenizer for captions, and batching.

Every reader yields ``(PIL.Image RGB, caption)`` pairs and raises one
:class:`~lmforge.utils.errors.LmforgeError` line naming the file (and line or tar member) for a
missing, corrupt, non-image or oversized image, or a malformed JSONL record.

Simplification: captions are tokenized by :class:`WordTokenizer`, a closed word vocabulary
(words split on spaces and punctuation, unknown words → ``<unk>``). That suits the procedural
captions exactly and small user sets well; a large open-vocabulary set would want lmforge's BPE.
Exercised by ``pytest tests/test_vision_data.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text, iter_jsonl

# The OpenAI CLIP normalisation constants (per-channel mean and std of its training images).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MAX_PIXELS = 64_000_000
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "ppm")
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<image>")
_WORD = re.compile(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]")


def load_image(
    source: str | os.PathLike | bytes, name: str = "", max_pixels: int = DEFAULT_MAX_PIXELS
):
    """Decode ``source`` (a path or the file's bytes) into an RGB ``PIL.Image``.

    The pixel count is checked from the header before decoding, so a huge image costs nothing.
    A missing, corrupt, truncated or non-image file, or more than ``max_pixels`` pixels: one
    LmforgeError line naming ``name`` (default: the path).
    """
    from PIL import Image, UnidentifiedImageError

    label = name or str(source if not isinstance(source, bytes) else "<bytes>")
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise LmforgeError(f"image not found: {label}")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb guard warns (or raises) past its limit; ours speaks first.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            fp = io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")
            with fp, Image.open(fp) as img:
                w, h = img.size
                if w * h > max_pixels:
                    raise LmforgeError(
                        f"{label}: image of {w}x{h} = {w * h} pixels exceeds the limit of"
                        f" {max_pixels} (raise max_pixels if it is intended)"
                    )
                return img.convert("RGB")
    except LmforgeError:
        raise
    except UnidentifiedImageError:  # PIL's message names only its file object
        raise LmforgeError(f"{label}: not a readable image (no known image format)") from None
    except (Image.DecompressionBombError, OSError, ValueError) as e:
        raise LmforgeError(f"{label}: not a readable image ({type(e).__name__}: {e})") from None


def preprocess(image, image_size: int) -> torch.Tensor:
    """CLIP's transform: resize the shorter side to ``image_size`` (bicubic), center-crop a
    square, scale to [0, 1] and normalise per channel. PIL image or (H, W, 3) uint8 array in,
    (3, image_size, image_size) float32 out."""
    from PIL import Image

    img = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    w, h = img.size
    if (w, h) != (image_size, image_size):
        scale = image_size / min(w, h)
        nw, nh = max(image_size, round(w * scale)), max(image_size, round(h * scale))
        img = img.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - image_size) // 2, (nh - image_size) // 2
        img = img.crop((left, top, left + image_size, top + image_size))
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).float() / 255.0  # (S, S, 3)
    x = x.permute(2, 0, 1)  # (3, S, S)
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    return (x - mean) / std


def denormalize(x: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`preprocess`'s normalisation: (..., 3, S, S) -> (..., S, S, 3) uint8."""
    mean = torch.tensor(CLIP_MEAN, device=x.device).view(3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device).view(3, 1, 1)
    img = (x.detach().float() * std + mean).clamp(0, 1) * 255  # (..., 3, S, S)
    return img.movedim(-3, -1).round().to(torch.uint8).cpu().numpy()


def iter_image_folder(
    jsonl: str | os.PathLike,
    root: str | os.PathLike | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Iterator[tuple[object, str]]:
    """(image, caption) for each line ``{"image": "relative/path.png", "caption": "..."}`` of
    ``jsonl`` (``"text"`` is accepted for the caption); paths are relative to ``root`` (default:
    the JSONL's folder)."""
    base = Path(root) if root is not None else Path(jsonl).parent
    for n, rec in iter_jsonl(jsonl, "caption file"):
        image, caption = rec.get("image"), rec.get("caption", rec.get("text"))
        if not isinstance(image, str) or not image:
            raise LmforgeError(f"{jsonl}:{n}: expected a string 'image' path")
        if not isinstance(caption, str):
            raise LmforgeError(f"{jsonl}:{n}: expected a string 'caption' (or 'text')")
        yield load_image(base / image, f"{jsonl}:{n}: {image}", max_pixels), caption


def iter_tar_shards(
    shards: Iterable[str | os.PathLike], max_pixels: int = DEFAULT_MAX_PIXELS
) -> Iterator[tuple[object, str]]:
    """(image, caption) pairs from WebDataset-style tar shards.

    The WebDataset convention: a sample is the consecutive members sharing a key (the member path
    up to the first dot of its file name), e.g. ``000017.jpg`` + ``000017.txt``; the caption comes
    from a ``.txt``/``.caption`` member or a ``.json`` member's ``caption``/``text`` field.
    """
    for shard in shards:
        try:
            with tarfile.open(shard, "r:*") as tar:
                yield from _tar_samples(tar, str(shard), max_pixels)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise LmforgeError(f"{shard}: not a readable tar shard ({e})") from None


def _tar_samples(tar: tarfile.TarFile, shard: str, max_pixels: int) -> Iterator[tuple[object, str]]:
    key: str | None = None
    parts: dict[str, bytes] = {}
    for member in tar:
        if not member.isfile():
            continue
        folder, _, fname = member.name.rpartition("/")
        stem, dot, ext = fname.partition(".")
        if not dot:
            continue
        member_key = f"{folder}/{stem}" if folder else stem
        if member_key != key:
            if key is not None:
                yield _tar_sample(shard, key, parts, max_pixels)
            key, parts = member_key, {}
        f = tar.extractfile(member)
        parts[ext.lower()] = f.read() if f is not None else b""
    if key is not None:
        yield _tar_sample(shard, key, parts, max_pixels)


def _tar_sample(
    shard: str, key: str, parts: dict[str, bytes], max_pixels: int
) -> tuple[object, str]:
    where = f"{shard}:{key}"
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
    if image_ext is None:
        raise LmforgeError(f"{where}: sample has no image member ({', '.join(sorted(parts))})")
    caption = None
    for ext in ("txt", "caption"):
        if ext in parts:
            caption = parts[ext].decode("utf-8", errors="replace").strip()
    if caption is None and "json" in parts:
        try:
            meta = json.loads(parts["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LmforgeError(f"{where}.json: not valid JSON ({e})") from None
        caption = meta.get("caption", meta.get("text")) if isinstance(meta, dict) else None
    if not isinstance(caption, str):
        raise LmforgeError(f"{where}: sample has no caption (.txt, .caption or .json 'caption')")
    return load_image(parts[image_ext], f"{where}.{image_ext}", max_pixels), caption


class WordTokenizer:
    """Words ↔ ids over a closed vocabulary; ids 0..4 are ``<pad> <unk> <bos> <eos> <image>``.

    ``encode`` splits on whitespace and punctuation (case kept: "A" the letter is not "a" the
    article) and maps unknown words to ``<unk>``; ``decode`` joins with spaces.
    """

    def __init__(self, words: Sequence[str]) -> None:
        extra = [w for w in dict.fromkeys(words) if w not in SPECIAL_TOKENS]
        self.itos: list[str] = [*SPECIAL_TOKENS, *extra]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}

    pad_id, unk_id, bos_id, eos_id, image_id = range(5)

    @classmethod
    def fit(cls, texts: Iterable[str], max_size: int = 8192) -> WordTokenizer:
        """The ``max_size`` most frequent words of ``texts`` (ties in first-seen order)."""
        counts: dict[str, int] = {}
        for text in texts:
            for w in _WORD.findall(text):
                counts[w] = counts.get(w, 0) + 1
        ranked = sorted(counts, key=lambda w: -counts[w])
        return cls(ranked[: max(0, max_size - len(SPECIAL_TOKENS))])

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included."""
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added); ``<image>`` is recognised as one token."""
        out = []
        for piece in re.split(r"(<image>)", text):
            if piece == "<image>":
                out.append(self.image_id)
            else:
                out.extend(self.stoi.get(w, self.unk_id) for w in _WORD.findall(piece))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Words of ``ids`` joined by spaces, padding dropped."""
        return " ".join(self.itos[i] for i in ids if i != self.pad_id and 0 <= i < len(self.itos))

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON (atomically)."""
        atomic_write_text(path, json.dumps({"words": self.itos}, indent=0))

    @classmethod
    def load(cls, path: str | os.PathLike) -> WordTokenizer:
        """Read a vocabulary written by :meth:`save`."""
        try:
            words = json.loads(Path(path).read_text(encoding="utf-8"))["words"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LmforgeError(f"{path}: not a word-tokenizer file ({e})") from None
        if list(words[: len(SPECIAL_TOKENS)]) != list(SPECIAL_TOKENS):
            raise LmforgeError(f"{path}: vocabulary must start with {', '.join(SPECIAL_TOKENS)}")
        return cls(words)


def encode_batch(
    tokenizer: WordTokenizer, texts: Sequence[str], context_length: int
) -> torch.Tensor:
    """(B, L) long: each text as ``<bos> words <eos>`` truncated to ``context_length`` (the EOS
    kept as the last token, since the text encoder pools there) and right-padded."""
    out = torch.full((len(texts), context_length), tokenizer.pad_id, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = [tokenizer.bos_id, *tokenizer.encode(text)][: context_length - 1]
        ids.append(tokenizer.eos_id)
        out[i, : len(ids)] = torch.tensor(ids)
    return out
