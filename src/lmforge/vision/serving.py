"""What the serving stack needs to answer prompts with images on a trained VLM.

- **Untrusted images in**: :func:`decode_data_url` (``data:image/...;base64,`` only: no URL is
  ever fetched) and :func:`decode_image` (the file's bytes). Limits on bytes (checked before the
  base64 is decoded) and pixels (read from the header before the pixels are decoded), and every
  decode failure, end in one :class:`~lmforge.utils.errors.LmforgeError` line.
- **Pixels**: :func:`image_pixels` runs the CLIP preprocessing the VLM was trained with
  (:func:`~lmforge.vision.data.preprocess`) and hashes the decoded RGB pixels (SHA-256 of the
  size and the bytes): the hash, not the file, names the image, so the same picture sent as PNG
  or as a re-encoded PNG shares a prefix-cache entry, and two different pictures never do.
- **Embeddings**: :class:`VisionTower` (the VLM's ViT + projector) and
  :func:`prepare_image_prompt`, which expands each ``<image>`` placeholder of a prompt to the N
  image-token slots the VLM was trained with and computes those slots' embeddings once per
  request: an :class:`ImagePrompt` (ids, (M·N, D) embeddings, spans, hashes) for the engine.
- **The checkpoint**: :func:`load_vlm` reads the folder ``lmforge vision vlm`` writes (its LM,
  ViT and projector from the latest stage-2 checkpoint, else stage 1, plus the vocabulary and
  the chat template) as a :class:`LoadedVLM`.

Simplification: an image is one fixed-size square (CLIP's resize + centre crop), N slots each,
as the VLM was trained; there is no any-resolution tiling. Exercised by
``pytest tests/test_vision_serve.py tests/test_serve_images.py tests/test_serve_images_server.py
tests/test_serve_images_cli.py``.

Shape legend: M images, N image tokens per image, D LM width, Dv ViT width, S image side.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmforge.utils.errors import LmforgeError
from lmforge.vision.data import SPECIAL_TOKENS, WordTokenizer, load_image, preprocess
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.vlm import Projector

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "VLM_CHAT_TEMPLATE",
    "ImagePrompt",
    "LoadedVLM",
    "VLMTokenizer",
    "VisionTower",
    "decode_data_url",
    "decode_image",
    "expand_placeholders",
    "image_pixels",
    "is_vlm_folder",
    "load_vlm",
    "prepare_image_prompt",
]

DEFAULT_MAX_IMAGE_BYTES = 16 << 20
"an image file larger than this (16 MiB) is refused before it is decoded"
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"an image with more pixels than this is refused from its header (before the pixels decode)"

# The VLM is trained on "<bos> <image>×N question → answer <eos>": one user turn, no roles.
# Several user messages are joined in order (the model never saw a multi-turn format).
VLM_CHAT_TEMPLATE = (
    "<bos>"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ message['content'] }} "
    "{% endif %}{% endfor %}"
)

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


def decode_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a ``data:[image/...];base64,...`` URL. Any other URL (http, file, ...) is
    refused, never fetched; a non-image MIME type, more than ``max_bytes`` decoded bytes
    (judged from the base64's length before decoding) or a base64 that does not decode raise
    one :class:`LmforgeError` line."""
    if not isinstance(url, str):
        raise LmforgeError(f"image_url must be a string, got {type(url).__name__}")
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0][:20] if ":" in url else url[:20]
        raise LmforgeError(
            f"image_url must be a base64 data URL (data:image/png;base64,...); {scheme!r} URLs "
            "are not fetched"
        )
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise LmforgeError(f"image_url has MIME type {mime!r}; expected an image/* type")
    payload = url[m.end() :]
    if (len(payload) * 3) // 4 > max_bytes + 2:  # base64: 4 characters carry 3 bytes
        raise LmforgeError(
            f"image of about {len(payload) * 3 // 4} bytes exceeds the limit of {max_bytes}"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise LmforgeError(f"image_url: the base64 payload does not decode ({e})") from None
    if not data:
        raise LmforgeError("image_url: the base64 payload is empty")
    return data


def decode_image(
    data: bytes,
    name: str = "image",
    *,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Any:
    """An RGB ``PIL.Image`` from an image file's bytes; too many bytes or pixels, or bytes that
    are not a readable image, raise one :class:`LmforgeError` line naming ``name``."""
    if len(data) > max_bytes:
        raise LmforgeError(f"{name}: {len(data)} bytes exceeds the image limit of {max_bytes}")
    return load_image(bytes(data), name, max_pixels)  # decodes every pixel: truncation shows


def image_digest(image: Any) -> str:
    """SHA-256 (hex) of an RGB image's size and decoded pixels: equal pixels, equal digest."""
    rgb = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))  # (H, W, 3)
    h = hashlib.sha256(f"{rgb.shape[1]}x{rgb.shape[0]}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def image_pixels(image: Any, image_size: int) -> tuple[torch.Tensor, str]:
    """``(preprocessed pixels (3, S, S) float32, digest)`` of a PIL image or an (H, W, 3) uint8
    array: the CLIP transform of training, and :func:`image_digest` of the decoded pixels."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise LmforgeError(f"an image array must be (H, W, 3) uint8, got {image.shape}")
        image = Image.fromarray(image)
    image = image.convert("RGB")
    return preprocess(image, image_size), image_digest(image)


class VisionTower(nn.Module):
    """The image side of a VLM for serving: ViT → projector, (M, 3, S, S) → (M, N, D).

    Holds the ``<image>`` id and N, the slots one image fills in a prompt, and the rows of the
    last ``cache_images`` images by pixel digest (:meth:`embed_rows`): an image sent again skips
    the forward, as its slots' KV is already in the engine's prefix cache. The tower's weights
    are fixed while it serves; after changing them, :meth:`clear_cache`."""

    def __init__(
        self, vision: ViT, projector: Projector, image_id: int, cache_images: int = 32
    ) -> None:
        super().__init__()
        self.vision, self.projector, self.image_id = vision, projector, image_id
        self.cache_images = cache_images
        self._rows: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    def clear_cache(self) -> None:
        """Forget every image's cached rows."""
        self._rows.clear()

    @classmethod
    def from_vlm(cls, vlm: nn.Module) -> VisionTower:
        """The tower of a :class:`~lmforge.vision.vlm.VisionLanguageModel` (its own modules)."""
        return cls(vlm.vision, vlm.projector, vlm.image_id)

    @property
    def image_size(self) -> int:
        """Side S of the square the images are resized and cropped to."""
        return self.vision.config.image_size

    @property
    def n_image_tokens(self) -> int:
        """Slots N one image fills (the ViT's patch count)."""
        return self.vision.config.n_patches

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(M, 3, S, S) preprocessed pixels -> (M, N, D) image tokens, in the tower's dtype."""
        p = next(self.parameters())
        return self.projector(self.vision(pixels.to(p.device, p.dtype))[1])  # (M, N, D)

    def embed_rows(
        self,
        pixels: Sequence[torch.Tensor | np.ndarray],
        digests: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """The slots' rows of M images' (3, S, S) pixels: (M·N, D) (M = 0 too). With their
        ``digests`` (:func:`image_pixels`), images seen lately take their cached rows and the
        rest go through one forward; without, every image does."""
        s = self.image_size
        for i, px in enumerate(pixels):
            if tuple(px.shape) != (3, s, s):
                raise LmforgeError(
                    f"image {i + 1}: pixels {tuple(px.shape)}, expected (3, {s}, {s})"
                )
        if not pixels:
            p = self.projector.fc2.weight
            return p.new_empty(0, p.shape[0])  # (0, D)
        if digests is None or self.cache_images <= 0:
            batch = torch.stack([torch.as_tensor(px) for px in pixels])  # (M, 3, S, S)
            return self(batch).flatten(0, 1)  # (M·N, D)
        new = [i for i, d in enumerate(digests) if d not in self._rows]
        fresh = {digests[i] for i in new}
        if new:
            batch = torch.stack([torch.as_tensor(pixels[i]) for i in new])  # (M', 3, S, S)
            for i, rows in zip(new, self(batch), strict=True):  # rows (N, D)
                self._rows[digests[i]] = rows
        out = torch.cat([self._rows[d] for d in digests])  # (M·N, D)
        for d in digests:  # most recently used last; the oldest beyond the bound go
            if d not in fresh:
                self._rows.move_to_end(d)
        while len(self._rows) > self.cache_images:
            self._rows.popitem(last=False)
        return out


@dataclasses.dataclass
class ImagePrompt:
    """A prompt with images, as the engine takes it.

    ``token_ids`` hold N ``<image>`` ids per image; ``embeds`` (M·N, D) are the rows that
    replace those slots' token embeddings, in order; ``spans`` give each image's (start, N)
    in ``token_ids`` and ``digests`` its pixel hash (the prefix-cache key of its slots)."""

    token_ids: list[int]
    embeds: torch.Tensor
    spans: list[tuple[int, int]]
    digests: list[str]

    def slot_keys(self) -> dict[int, str]:
        """Position -> digest of the image filling it (what a prefix-cache key must hold)."""
        return {
            p: d
            for (s, n), d in zip(self.spans, self.digests, strict=True)
            for p in range(s, s + n)
        }


def expand_placeholders(
    prompt_ids: Sequence[int], image_id: int, n_image_tokens: int, n_images: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """``(ids, spans)``: each ``<image>`` id of ``prompt_ids`` (one per image, in order) becomes
    ``n_image_tokens`` slots; ``spans`` holds each image's (start, length) in ``ids``. A
    placeholder count other than ``n_images`` raises one line."""
    n_holders = sum(1 for t in prompt_ids if t == image_id)
    if n_holders != n_images:
        raise LmforgeError(
            f"the prompt has {n_holders} <image> placeholder(s) but {n_images} image(s) were "
            "given (one placeholder per image)"
        )
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for t in prompt_ids:
        if t == image_id:
            spans.append((len(ids), n_image_tokens))
            ids.extend([image_id] * n_image_tokens)
        else:
            ids.append(int(t))
    return ids, spans


@torch.no_grad()
def prepare_image_prompt(
    tower: VisionTower,
    prompt_ids: Sequence[int],
    images: Sequence[Any],
    *,
    pixels: Sequence[tuple[torch.Tensor, str]] | None = None,
) -> ImagePrompt:
    """Expand the ``<image>`` placeholders of ``prompt_ids`` (one per image, in order) to N slots
    each (:func:`expand_placeholders`) and compute the slots' embeddings in one tower forward.

    ``images``: PIL images, (H, W, 3) uint8 arrays or image files' bytes (decoded with
    :func:`decode_image`). ``pixels`` instead gives each image already preprocessed with its
    digest (:func:`image_pixels`); then ``images`` is ignored.
    """
    if pixels is None:
        pixels = [
            image_pixels(
                decode_image(bytes(im), f"image {i + 1}")
                if isinstance(im, bytes | bytearray)
                else im,
                tower.image_size,
            )
            for i, im in enumerate(images)
        ]
    ids, spans = expand_placeholders(prompt_ids, tower.image_id, tower.n_image_tokens, len(pixels))
    return ImagePrompt(
        ids,
        tower.embed_rows([px for px, _ in pixels], [d for _, d in pixels]),
        spans,
        [d for _, d in pixels],
    )


class VLMTokenizer:
    """A VLM's :class:`~lmforge.vision.data.WordTokenizer` for serving: ``<bos>``, ``<eos>``
    and ``<image>`` in text are their ids (chat templates write them), ``eot_id`` is EOS, and
    ``decode`` drops the special tokens (a reply's text has none)."""

    _SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    def __init__(self, words: WordTokenizer) -> None:
        self.words = words
        self.vocab_size = words.vocab_size
        self.eot_id = words.eos_id
        self.image_id = words.image_id

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; the special tokens written out are their own ids."""
        out: list[int] = []
        for piece in self._SPECIAL.split(text):
            if piece in SPECIAL_TOKENS:
                out.append(SPECIAL_TOKENS.index(piece))
            elif piece:
                out.extend(self.words.encode(piece))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Words of ``ids`` joined by spaces, special tokens dropped."""
        return self.words.decode(i for i in ids if i >= len(SPECIAL_TOKENS))


@dataclasses.dataclass
class LoadedVLM:
    """A VLM run folder, ready to serve: the LM the engine runs, the tower, text tools."""

    vlm: nn.Module
    "the whole VisionLanguageModel (its training forward; ``lm`` and ``tower`` share its modules)"
    lm: nn.Module
    "the language model (a TransformerLM): the engine's model"
    tower: VisionTower
    "ViT + projector: image embeddings for the prompts"
    tokenizer: VLMTokenizer
    template: str
    "the chat template of the training format"
    name: str


def is_vlm_folder(path: str | Path) -> bool:
    """Whether ``path`` is a run folder written by ``lmforge vision vlm`` (a config.toml beside
    vision.toml, or beside its stage folders: an older run, which :func:`load_vlm` explains)."""
    p = Path(path)
    marks = (p / "vision.toml").is_file() or (p / "stage1").is_dir() or (p / "stage2").is_dir()
    return (p / "config.toml").is_file() and marks


def load_vlm(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LoadedVLM:
    """The VLM of a ``lmforge vision vlm`` run folder: its ``config.toml`` (the LM's shape),
    ``vision.toml`` (the ViT's), ``vocab.json`` and the latest checkpoint of ``stage2/``
    (``stage1/`` when stage 2 was skipped). Missing or mismatched files: one line."""
    from lmforge.checkpoint import latest_checkpoint, load_model_state
    from lmforge.model import TransformerLM
    from lmforge.utils.config import load_config
    from lmforge.vision.vlm import VisionLanguageModel
    from lmforge.vision.vlm_train import VLMRunConfig

    p = Path(folder)
    if not p.is_dir():
        raise LmforgeError(f"VLM folder not found: {p}")
    for name in ("config.toml", "vision.toml", "vocab.json"):
        if not (p / name).is_file():
            raise LmforgeError(
                f"{p} has no {name}: a `lmforge vision vlm` run folder holds config.toml, "
                "vision.toml and vocab.json (a run older than them: run the same `lmforge vision "
                "vlm` command again; it resumes and writes them)"
            )
    ckpt = None
    for stage in ("stage2", "stage1"):
        if (p / stage).is_dir() and (ckpt := latest_checkpoint(p / stage)) is not None:
            break
    if ckpt is None:
        raise LmforgeError(f"{p} has no stage2/ or stage1/ checkpoint (did the run finish?)")
    try:
        cfg = load_config(VLMRunConfig, p / "config.toml")
        vit_cfg = load_config(ViTConfig, p / "vision.toml")
    except (ValueError, TypeError) as e:
        raise LmforgeError(f"{p}: {e}") from None
    words = WordTokenizer.load(p / "vocab.json")
    vlm = VisionLanguageModel(ViT(vit_cfg), TransformerLM(cfg.lm), words.image_id)
    state = load_model_state(ckpt / "model.safetensors")
    try:
        vlm.load_state_dict(state)
    except RuntimeError as e:
        first = " ".join(str(e).strip().splitlines()[:2])
        raise LmforgeError(f"{ckpt}: the weights do not fit the configs ({first})") from None
    vlm = vlm.to(device=device, dtype=dtype).eval()
    template = VLM_CHAT_TEMPLATE
    if (p / "chat_template.jinja").is_file():
        template = (p / "chat_template.jinja").read_text(encoding="utf-8")
    tower = VisionTower.from_vlm(vlm)
    return LoadedVLM(vlm, vlm.lm, tower, VLMTokenizer(words), template, p.resolve().name)
