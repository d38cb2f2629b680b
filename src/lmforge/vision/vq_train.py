"""``lmforge vision vqvae``: discrete image tokens (Chameleon-style) on procedural scenes.

1. A :class:`~lmforge.vision.vqvae.VQVAE` is trained on scenes (:class:`VQObjective`):
   held-out reconstruction MSE (pixels in [0, 1]) and codebook perplexity, plus
   ``recon.png`` (rows: originals, reconstructions).
2. An lmforge ``TransformerLM`` (QK-norm and z-loss on: the two fixes Chameleon needed for a
   stable mixed-modality stream) is trained on interleaved sequences
   (:class:`ImageTokenLMObjective`), half ``caption <boi> image <eoi>`` (generation) and half
   ``<boi> image <eoi> caption`` (captioning), every token predicted. It then captions held-out
   images (greedy), generates images for held-out captions (``samples.png``), decodes them to
   pixels, re-encodes them with the VQ-VAE and captions them again. Captions are scored per
   attribute against the scene graph (:func:`score_captions`), beside a prior baseline: the
   caption of another random scene, scored the same way.

Token layout of the LM's vocabulary: the word ids, then ``<boi>``, ``<eoi>``, then the K codes.
Decoding here re-runs the full forward per token (the slow reference; sequences are ~80 tokens).
Exercised by ``pytest tests/test_vision_vqvae.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.config import ModelConfig
from lmforge.utils.config import save_config
from lmforge.utils.io import atomic_write_bytes, atomic_write_text
from lmforge.vision._train import check_phase
from lmforge.vision.data import WordTokenizer, denormalize, preprocess
from lmforge.vision.scenes import (
    COLORS,
    COLS,
    NUMBER_WORDS,
    ROWS,
    SIZES,
    ProceduralScenes,
    Scene,
    vocabulary,
)
from lmforge.vision.vqvae import VQVAE, CodebookUpdate, VQConfig


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    """Optimisation of one phase."""

    steps: int = 1500
    "optimizer steps"
    batch_size: int = 32
    "images (VQ) or sequences (LM) per step"
    lr: float = 2e-3
    "peak learning rate (AdamW, warm-up then cosine to lr/10)"
    warmup: int = 50
    "warm-up steps"
    z_loss: float = 1e-4
    "LM only: weight of the z-loss, mean of logsumexp(logits)² (PaLM; 0 = off)"

    def __post_init__(self) -> None:
        check_phase("", steps=self.steps, batch_size=self.batch_size,
                    lr=self.lr, warmup=self.warmup, z_loss=self.z_loss)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class VQRunSection:
    """Data, device and outputs of the run (``[run]``)."""

    image_size: int = 48
    "scene side in pixels (a multiple of 8: the code grid is S/8 × S/8)"
    max_objects: int = 3
    "objects per scene: 1..max_objects"
    seed: int = 0
    "seed of weights, scenes and samples"
    eval_images: int = 256
    "held-out scenes for MSE, perplexity and captioning"
    samples: int = 16
    "images generated from held-out captions (samples.png, read-back accuracy)"
    device: str = "cpu"
    "cpu, cuda, auto"
    threads: int = 0
    "CPU threads for torch (0 = torch's default)"
    out: str = "runs/vision/vq-tiny"
    "run folder: config.toml, vq/ and lm/ (Trainer folders), recon.png, samples.png, results.json"


@dataclasses.dataclass(frozen=True)
class VQRunConfig:
    """A VQ-VAE + image-token LM run."""

    vq: VQConfig = dataclasses.field(default_factory=VQConfig)
    "the VQ-VAE"
    vq_train: PhaseConfig = dataclasses.field(default_factory=PhaseConfig)
    "its training"
    lm: ModelConfig = dataclasses.field(
        default_factory=lambda: ModelConfig(
            vocab_size=512, context_length=128, d_model=128, n_layers=4, n_heads=4, qk_norm=True
        )
    )
    "the interleaved LM (vocab_size is set from the words and the codebook)"
    lm_train: PhaseConfig = dataclasses.field(default_factory=PhaseConfig)
    "its training"
    run: VQRunSection = dataclasses.field(default_factory=VQRunSection)
    "data, device, outputs"


class VQObjective:
    """VQ-VAE reconstruction + commitment on scene images; ``loss`` = (batch loss, 1)."""

    name = "vqvae"

    def __init__(self, scenes: ProceduralScenes, batch_size: int) -> None:
        self.scenes, self.batch_size, self.position = scenes, batch_size, 0
        self._last: dict[str, float] = {}

    def next_batch(self) -> torch.Tensor:
        """(B, 3, S, S) normalised images."""
        imgs = [
            preprocess(self.scenes[self.position + i].image, self.scenes.image_size)
            for i in range(self.batch_size)
        ]
        self.position += self.batch_size
        return torch.stack(imgs)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MSE + β·commitment, 1)."""
        out = model(batch.to(next(model.parameters()).device))
        self._last = {"mse": out["mse"].item(), "perplexity": out["perplexity"].item()}
        return out["loss"], torch.ones((), device=out["loss"].device)

    def metrics(self) -> dict[str, float]:
        """Last batch's MSE (normalised pixels) and code perplexity."""
        return dict(self._last)

    def state_dict(self) -> dict:
        """Scenes consumed."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state['position']`` scenes."""
        self.position = int(state["position"])


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where words, ``<boi>``, ``<eoi>`` and codes sit in the interleaved LM's vocabulary."""

    n_words: int
    n_codes: int

    @property
    def boi(self) -> int:
        """Begin-of-image id."""
        return self.n_words

    @property
    def eoi(self) -> int:
        """End-of-image id."""
        return self.n_words + 1

    @property
    def first_code(self) -> int:
        """Id of code 0."""
        return self.n_words + 2

    @property
    def vocab_size(self) -> int:
        """All ids."""
        return self.n_words + 2 + self.n_codes


def interleave(
    tok: WordTokenizer, layout: TokenLayout, caption: str, codes: torch.Tensor, generate: bool
) -> list[int]:
    """``<bos> caption <boi> codes <eoi> <eos>`` (generate) or ``<bos> <boi> codes <eoi> caption
    <eos>`` (caption); ``codes`` (h, w) in row-major order."""
    image = [layout.boi, *(codes.flatten() + layout.first_code).tolist(), layout.eoi]
    words = tok.encode(caption)
    body = words + image if generate else image + words
    return [tok.bos_id, *body, tok.eos_id]


class ImageTokenLMObjective:
    """Next-token loss (+ z-loss) on interleaved caption/image-code sequences; ``loss`` returns
    (summed token losses, token count). Images are encoded by the frozen VQ-VAE per batch."""

    name = "image-token-lm"

    def __init__(
        self,
        scenes: ProceduralScenes,
        vq: VQVAE,
        tok: WordTokenizer,
        batch_size: int,
        z_loss: float,
    ) -> None:
        self.scenes, self.vq, self.tok = scenes, vq, tok
        self.layout = TokenLayout(tok.vocab_size, vq.config.codebook_size)
        self.batch_size, self.z_loss, self.position = batch_size, z_loss, 0
        self._last: dict[str, float] = {}

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (B, T), targets (B, T)); targets -100 on padding."""
        samples = [self.scenes[self.position + i] for i in range(self.batch_size)]
        images = torch.stack([preprocess(s.image, self.scenes.image_size) for s in samples])
        codes = self.vq.encode(images.to(next(self.vq.parameters()).device)).cpu()  # (B, h, w)
        seqs = [
            interleave(self.tok, self.layout, s.caption, c, generate=(self.position + i) % 2 == 0)
            for i, (s, c) in enumerate(zip(samples, codes, strict=True))
        ]
        self.position += self.batch_size
        t = max(len(s) for s in seqs) - 1
        inputs = torch.full((len(seqs), t), self.tok.pad_id, dtype=torch.long)
        targets = torch.full((len(seqs), t), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
            targets[i, : len(s) - 1] = torch.tensor(s[1:])
        return inputs, targets

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ CE + z_loss · Σ logsumexp², number of predicted tokens)."""
        device = next(model.parameters()).device
        inputs, targets = (t.to(device) for t in batch)
        logits = model(inputs).float()  # (B, T, V)
        keep = targets != -100  # (B, T)
        ce = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
        z = torch.logsumexp(logits[keep], dim=-1)  # (M,)
        n = keep.sum()
        self._last = {"ce": ce.item() / max(1, n.item()), "z": z.mean().item()}
        return ce + self.z_loss * z.pow(2).sum(), n

    def metrics(self) -> dict[str, float]:
        """Last batch's mean CE and mean logsumexp (z)."""
        return dict(self._last)

    def state_dict(self) -> dict:
        """Scenes consumed."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state['position']`` scenes."""
        self.position = int(state["position"])


@torch.no_grad()
def decode_restricted(
    lm: nn.Module,
    prefix: torch.Tensor,
    steps: int,
    allowed: torch.Tensor,
    temperature: float = 0.0,
    stop: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``prefix`` (B, T) by ``steps`` tokens drawn only from ids where ``allowed`` (V,)
    is True: greedy at temperature 0, else sampled; rows that produced ``stop`` keep emitting
    it. Full forward per token (the reference decoder). Returns the (B, steps) new tokens."""
    seq = prefix
    mask = torch.where(allowed, 0.0, float("-inf")).to(prefix.device)  # (V,)
    done = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
    for _ in range(steps):
        logits = lm(seq)[:, -1].float() + mask  # (B, V)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)[:, 0]
        else:
            nxt = logits.argmax(-1)
        if stop is not None:
            nxt = torch.where(done, torch.full_like(nxt, stop), nxt)
            done |= nxt == stop
        seq = torch.cat([seq, nxt[:, None]], 1)
        if stop is not None and done.all():
            break
    return seq[:, prefix.shape[1] :]


def caption_codes(
    lm: nn.Module, tok: WordTokenizer, layout: TokenLayout, codes: torch.Tensor, max_words: int = 48
) -> list[str]:
    """Greedy captions of (B, h, w) code grids (only word ids and EOS are allowed)."""
    device = next(lm.parameters()).device
    image = codes.flatten(1) + layout.first_code  # (B, h·w)
    head = torch.tensor([tok.bos_id, layout.boi])
    prefix = torch.cat(
        [head.expand(len(codes), 2), image.cpu(), torch.full((len(codes), 1), layout.eoi)], 1
    )
    allowed = torch.zeros(layout.vocab_size, dtype=torch.bool)
    allowed[5 : layout.n_words] = True
    allowed[tok.eos_id] = True
    out = decode_restricted(lm, prefix.to(device), max_words, allowed, stop=tok.eos_id)
    return [tok.decode(t for t in row.tolist() if t != tok.eos_id) for row in out]


def generate_codes(
    lm: nn.Module,
    tok: WordTokenizer,
    layout: TokenLayout,
    caption: str,
    n: int,
    grid: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """(n, grid, grid) code ids sampled (temperature 1) for ``caption``, only code ids allowed."""
    device = next(lm.parameters()).device
    prefix = torch.tensor([tok.bos_id, *tok.encode(caption), layout.boi]).expand(n, -1)
    allowed = torch.zeros(layout.vocab_size, dtype=torch.bool)
    allowed[layout.first_code :] = True
    out = decode_restricted(lm, prefix.to(device), grid * grid, allowed, 1.0, generator=generator)
    return (out - layout.first_code).view(n, grid, grid)


_KINDS = ("circle", "square", "triangle", "digit", "letter")
ATTRIBUTES = ("count", "position", "kind", "name", "color", "size", "exact")


def parse_caption(text: str) -> tuple[int | None, dict[tuple[int, int], dict[str, str]]]:
    """A caption (as :meth:`Scene.caption` writes it, or a model's attempt) -> (object count
    or None, {(row, col): {"kind", "name", "color", "size"}}). Lenient: a clause without a
    position is dropped, a missing attribute is "" and the first clause at a cell wins."""
    words = text.split()
    count = NUMBER_WORDS.index(words[0]) if words and words[0] in NUMBER_WORDS else None
    body = text.split(":", 1)[1] if ":" in text else text
    objects: dict[tuple[int, int], dict[str, str]] = {}
    for clause in body.replace(" .", " ").split(" and "):
        w = clause.split()
        if "at" not in w:
            continue
        head, tail = w[: w.index("at")], w[w.index("at") + 1 :]
        if tail[:1] == ["the"]:
            tail = tail[1:]
        if len(tail) < 2 or tail[0] not in ROWS or tail[1] not in COLS:
            continue
        cell = (ROWS.index(tail[0]), COLS.index(tail[1]))
        kind = next((x for x in head if x in _KINDS), "")
        glyph = (
            head[head.index(kind) + 1] if kind in ("digit", "letter") and head[-1] != kind else ""
        )
        objects.setdefault(
            cell,
            {
                "kind": kind,
                "name": f"{kind} {glyph}" if glyph else kind,
                "color": next((x for x in head if x in COLORS), ""),
                "size": next((x for x in head if x in SIZES), ""),
            },
        )
    return count, objects


def score_captions(said: list[str], scenes: list[Scene]) -> dict[str, float]:
    """Per-attribute accuracy of captions against their scene graphs.

    count and exact: per caption (the count word; the whole caption equals
    :meth:`Scene.caption`). position, kind, name (kind with its digit/letter), color, size: per
    object of the scene graph, micro-averaged — an object is right on an attribute when the
    caption puts an object at its cell with that attribute (position: any object at its cell).
    """
    hits = dict.fromkeys(ATTRIBUTES, 0.0)
    n_objects = 0
    for text, scene in zip(said, scenes, strict=True):
        count, objects = parse_caption(text)
        hits["count"] += count == len(scene.objects)
        hits["exact"] += text == scene.caption()
        for o in scene.objects:
            n_objects += 1
            got = objects.get((o.row, o.col))
            if got is None:
                continue
            hits["position"] += 1
            truth = {"kind": o.kind, "name": o.name, "color": o.color, "size": o.size}
            for key, value in truth.items():
                hits[key] += got[key] == value
    per_caption = {"count", "exact"}
    return {k: v / max(1, len(said) if k in per_caption else n_objects) for k, v in hits.items()}


def png_grid(images: np.ndarray, cols: int, scale: int = 2) -> bytes:
    """(N, H, W, 3) uint8 -> PNG bytes of a grid with ``cols`` columns, upscaled ``scale``×."""
    from PIL import Image

    n, h, w, _ = images.shape
    rows = -(-n // cols)
    canvas = np.full((rows * (h + 2), cols * (w + 2), 3), 255, np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        canvas[r * (h + 2) + 1 : r * (h + 2) + 1 + h, c * (w + 2) + 1 : c * (w + 2) + 1 + w] = img
    pil = Image.fromarray(canvas).resize(
        (canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST
    )
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return buf.getvalue()


@torch.no_grad()
def evaluate_vq(vq: VQVAE, scenes: ProceduralScenes, n: int) -> dict[str, float]:
    """Held-out reconstruction MSE (pixels in [0, 1]) and perplexity of the code usage."""
    vq.eval()
    device = next(vq.parameters()).device
    images = torch.stack([preprocess(scenes[i].image, scenes.image_size) for i in range(n)]).to(
        device
    )
    codes = vq.encode(images)
    recon = vq.decode(codes)
    real = torch.from_numpy(denormalize(images)).float() / 255
    fake = torch.from_numpy(denormalize(recon)).float() / 255
    usage = torch.bincount(codes.flatten(), minlength=vq.config.codebook_size).float()
    p = usage / usage.sum()
    perplexity = torch.exp(-(p * torch.log(p + 1e-10)).sum()).item()
    vq.train()
    return {
        "recon_mse": F.mse_loss(fake, real).item(),
        "perplexity": perplexity,
        "codes_used": float((usage > 0).sum()),
    }


def run_vq(cfg: VQRunConfig, log: Callable[[dict], None] = print) -> dict[str, float]:
    """Both phases and the evaluations; writes ``cfg.run.out`` and returns the results."""
    from lmforge.model import TransformerLM
    from lmforge.vision._train import phase_train_config, run_phase
    from lmforge.vision.contrastive import pick_device

    r = cfg.run
    if r.threads:
        torch.set_num_threads(r.threads)
    device = pick_device(r.device)
    out = Path(r.out)
    tok = WordTokenizer(vocabulary())
    layout = TokenLayout(tok.vocab_size, cfg.vq.codebook_size)
    lm_cfg = dataclasses.replace(cfg.lm, vocab_size=layout.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, lm=lm_cfg), out / "config.toml")
    train = ProceduralScenes(r.seed, "train", r.image_size, r.max_objects)
    val = ProceduralScenes(r.seed, "val", r.image_size, r.max_objects)

    def fit(objective, model, phase: PhaseConfig, name: str, callbacks=()) -> None:
        tc = phase_train_config(out / name, steps=phase.steps, lr=phase.lr, warmup=phase.warmup,
                                batch_size=phase.batch_size, device=device, seed=r.seed)  # fmt: skip
        run_phase(objective, model, tc, lambda rec: log({"phase": name, **rec}), callbacks)

    torch.manual_seed(r.seed)
    vq = VQVAE(cfg.vq)
    # the codebook is not trained by AdamW (buffers): its EMA step runs after each step
    fit(VQObjective(train, cfg.vq_train.batch_size), vq, cfg.vq_train, "vq", [CodebookUpdate(vq)])
    results = evaluate_vq(vq, val, r.eval_images)
    log({"phase": "vq", **results})
    vq.eval()
    show = torch.stack([preprocess(val[i].image, r.image_size) for i in range(8)]).to(device)
    recon = vq.decode(vq.encode(show))
    atomic_write_bytes(
        out / "recon.png", png_grid(np.concatenate([denormalize(show), denormalize(recon)]), 8)
    )

    lm = TransformerLM(lm_cfg)
    vq.requires_grad_(False)
    fit(
        ImageTokenLMObjective(train, vq, tok, cfg.lm_train.batch_size, cfg.lm_train.z_loss),
        lm,
        cfg.lm_train,
        "lm",
    )
    lm.eval()
    n_cap = min(r.eval_images, 128)
    real = torch.stack([preprocess(val[i].image, r.image_size) for i in range(n_cap)]).to(device)
    said = caption_codes(lm, tok, layout, vq.encode(real))
    truth = [val[i].scene for i in range(n_cap)]
    results |= {f"caption_{k}": v for k, v in score_captions(said, truth).items()}
    # prior baseline: each scene scored with the caption of another (independent) val scene
    others = [val[5000 + i].caption for i in range(n_cap)]
    results |= {f"baseline_{k}": v for k, v in score_captions(others, truth).items()}
    gen = torch.Generator().manual_seed(r.seed)
    prompts = [val[1000 + i] for i in range(r.samples)]
    codes = torch.cat(
        [generate_codes(lm, tok, layout, p.caption, 1, r.image_size // 8, gen) for p in prompts]
    )
    # through pixels: what the LM reads back is what the decoded image shows, not its own tokens
    pixels = vq.decode(codes.to(device))  # (N, 3, S, S)
    reencoded = vq.encode(pixels)  # (N, h, w)
    results["gen_reencode_same_codes"] = (reencoded.cpu() == codes).float().mean().item()
    read_back = caption_codes(lm, tok, layout, reencoded)
    scored = score_captions(read_back, [p.scene for p in prompts])
    results |= {f"gen_caption_{k}": v for k, v in scored.items()}
    results["codebook_size"] = float(cfg.vq.codebook_size)
    atomic_write_bytes(out / "samples.png", png_grid(denormalize(pixels), 8))
    atomic_write_text(
        out / "samples.json",
        json.dumps(
            [
                {"prompt": p.caption, "read_back": b}
                for p, b in zip(prompts, read_back, strict=True)
            ],
            indent=1,
        )
        + "\n",
    )
    log({"phase": "lm", **results})
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    return results
