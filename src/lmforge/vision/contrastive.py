"""Contrastive image–text pretraining (CLIP or SigLIP) and zero-shot retrieval evaluation.

``lmforge vision pretrain --config configs/vision/clip-tiny.toml`` runs :func:`pretrain`: it
builds the tokenizer and the :class:`~lmforge.vision.encoders.DualEncoder`, trains it with
:class:`ContrastiveObjective` in the one :class:`~lmforge.train.Trainer` (its AdamW with CLIP's
β2 = 0.98 and ε = 1e-6, cosine schedule, clipping, checkpoints and exact resume) and reports
recall@1/@5 in both directions on held-out pairs (procedural ``val`` scenes, or
``data.val_path``). Exercised by ``pytest tests/test_vision_pretrain.py``.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lmforge.utils.config import save_config
from lmforge.utils.errors import LmforgeError
from lmforge.vision._train import check_phase
from lmforge.vision.data import (
    DEFAULT_MAX_PIXELS,
    WordTokenizer,
    encode_batch,
    iter_image_folder,
    iter_tar_shards,
    preprocess,
)
from lmforge.vision.encoders import DualEncoder, TextConfig, ViTConfig
from lmforge.vision.losses import clip_loss, retrieval_recall, siglip_loss
from lmforge.vision.scenes import ProceduralScenes, vocabulary


@dataclasses.dataclass(frozen=True)
class ImageDataConfig:
    """Where image–caption pairs come from (``[data]``)."""

    source: Literal["procedural", "folder", "tar"] = "procedural"
    "procedural scenes, a JSONL of {image, caption} beside its images, or WebDataset tar shards"
    path: str = ""
    "folder: the JSONL file; tar: a glob of shard files"
    val_path: str = ""
    "held-out pairs for retrieval (same format as path); procedural: its val split"
    seed: int = 0
    "procedural: the scene seed"
    max_objects: int = 3
    "procedural: objects per scene are 1..max_objects"
    render_size: int = 64
    "procedural: side the scenes are drawn at (then resized to the model's input like any image)"
    val_size: int = 512
    "held-out pairs scored by retrieval (chance recall@k = k / val_size)"
    max_pixels: int = DEFAULT_MAX_PIXELS
    "images with more pixels are refused (one error line) before decoding"
    vocab: str = ""
    "word vocabulary JSON (default: the procedural vocabulary, or fitted on the captions)"
    workers: int = 0
    "procedural: processes drawing the scenes of a batch (0 = in this process)"


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Optimisation of the contrastive run (``[train]``)."""

    loss: Literal["clip", "siglip"] = "clip"
    "CLIP's symmetric softmax or SigLIP's pairwise sigmoid"
    batch_size: int = 64
    "pairs per step (per rank)"
    steps: int = 300
    "optimizer steps"
    lr: float = 1e-3
    "peak learning rate (AdamW; linear warm-up, cosine to lr/10)"
    warmup: int = 30
    "warm-up steps"
    weight_decay: float = 0.1
    "AdamW weight decay on matrices (the Trainer's groups: not on norms, scale or bias)"
    grad_clip: float = 1.0
    "global gradient-norm clip"
    eval_every: int = 100
    "steps between retrieval evaluations (0 = only at the end)"
    save_every: int = 100
    "steps between checkpoints in out (0 = only at the end)"
    seed: int = 0
    "seed of the weights"
    device: str = "cpu"
    "cpu, cuda, auto"
    threads: int = 0
    "CPU threads for torch (0 = torch's default; 1 is fastest on a machine shared with other jobs)"
    out: str = "runs/vision/clip-tiny"
    "run folder: config.toml, vocab.json, results.json, train/ (metrics, checkpoints)"

    def __post_init__(self) -> None:
        check_phase(
            "train",
            batch_size=self.batch_size,
            steps=self.steps,
            lr=self.lr,
            warmup=self.warmup,
            eval_every=self.eval_every,
            save_every=self.save_every,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
        )


@dataclasses.dataclass(frozen=True)
class JointConfig:
    """The joint embedding space (``[joint]``)."""

    embed_dim: int = 128
    "width of the space both towers project into"


@dataclasses.dataclass(frozen=True)
class ContrastiveRunConfig:
    """A contrastive pretraining run."""

    vision: ViTConfig = dataclasses.field(default_factory=ViTConfig)
    "image tower"
    text: TextConfig = dataclasses.field(default_factory=TextConfig)
    "text tower"
    joint: JointConfig = dataclasses.field(default_factory=JointConfig)
    "joint embedding space"
    data: ImageDataConfig = dataclasses.field(default_factory=ImageDataConfig)
    "image–caption pairs"
    train: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    "optimisation"


def pair_stream(
    cfg: ImageDataConfig, split: str = "train", start: int = 0
) -> Iterator[tuple[Any, str]]:
    """(image, caption) pairs from ``cfg``, starting at pair ``start``, cycling over files."""
    if cfg.source == "procedural":
        scenes = ProceduralScenes(cfg.seed, split, cfg.render_size, cfg.max_objects)
        return ((s.image, s.caption) for s in scenes.stream(start))
    path = cfg.path if split == "train" else cfg.val_path
    if not path:
        raise LmforgeError(
            f"data.{'path' if split == 'train' else 'val_path'} is required for source {cfg.source}"
        )
    if cfg.source == "folder":
        opener: Callable[[], Iterator] = lambda: iter_image_folder(path, max_pixels=cfg.max_pixels)
    else:
        shards = sorted(glob.glob(path))
        if not shards:
            raise LmforgeError(f"no tar shards match {path!r}")
        opener = lambda: iter_tar_shards(shards, cfg.max_pixels)
    if split != "train":
        return opener()
    return itertools.islice(
        itertools.chain.from_iterable(opener() for _ in itertools.count()), start, None
    )


def build_tokenizer(cfg: ImageDataConfig) -> WordTokenizer:
    """The caption vocabulary: ``cfg.vocab``, the procedural words, or fitted on the captions."""
    if cfg.vocab:
        return WordTokenizer.load(cfg.vocab)
    if cfg.source == "procedural":
        return WordTokenizer(vocabulary())
    captions = (c for _, c in itertools.islice(pair_stream(cfg), 100_000))
    return WordTokenizer.fit(captions)


class ContrastiveObjective:
    """CLIP/SigLIP on streamed pairs: ``loss`` returns (batch loss, 1) — the loss couples every
    pair of the batch, so it is not a sum of per-pair terms and micro-batches cannot be split."""

    name = "contrastive"

    def __init__(
        self,
        data: ImageDataConfig,
        tokenizer: WordTokenizer,
        image_size: int,
        context_length: int,
        batch_size: int,
        loss: str = "clip",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.data, self.tokenizer = data, tokenizer
        self.image_size, self.context_length = image_size, context_length
        self.batch_size, self.kind = batch_size, loss
        self.rank, self.world_size = rank, world_size
        self.batches = 0
        self._stream: Iterator | None = None
        self._pool: Any = None
        self._last: dict[str, float] = {}

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images (B, 3, S, S), tokens (B, L)): this rank's B pairs of the next global batch."""
        if self.data.source == "procedural" and self.data.workers > 0:
            return self._procedural_batch()
        if self._stream is None:
            start = self.batches * self.batch_size * self.world_size
            self._stream = pair_stream(self.data, "train", start)
        pairs = list(itertools.islice(self._stream, self.batch_size * self.world_size))
        mine = pairs[self.rank :: self.world_size]
        self.batches += 1
        images = torch.stack([preprocess(img, self.image_size) for img, _ in mine])
        tokens = encode_batch(self.tokenizer, [c for _, c in mine], self.context_length)
        return images, tokens

    def _procedural_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # the same pairs as the stream (global index batch·B·W + rank + k·W), drawn in parallel
        if self._pool is None:
            import concurrent.futures
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
            self._pool = concurrent.futures.ProcessPoolExecutor(self.data.workers, mp_context=ctx)
        first = self.batches * self.batch_size * self.world_size + self.rank
        index = list(range(first, first + self.batch_size * self.world_size, self.world_size))
        chunks = [index[i :: self.data.workers] for i in range(self.data.workers)]
        args = (self.data.seed, self.data.max_objects, self.data.render_size, self.image_size)
        parts = list(self._pool.map(_draw_pairs, [(args, c) for c in chunks if c]))
        by_index = {i: pair for part in parts for i, pair in part}
        self.batches += 1
        images = torch.stack([by_index[i][0] for i in index])
        tokens = encode_batch(self.tokenizer, [by_index[i][1] for i in index], self.context_length)
        return images, tokens

    def batch_weight(self, batch: Any) -> float:
        """Every batch weighs 1."""
        return 1.0

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(contrastive loss of the batch, 1)."""
        device = next(model.parameters()).device
        images, tokens = (t.to(device) for t in batch)
        img, txt = model(images, tokens)
        if self.kind == "clip":
            loss = clip_loss(img, txt, model.logit_scale)
        else:
            loss = siglip_loss(img, txt, model.logit_scale, model.logit_bias)
        self._last = {"temperature": 1.0 / model.logit_scale.exp().item()}
        if self.kind == "siglip":
            self._last["bias"] = model.logit_bias.item()
        return loss, torch.ones((), device=device)

    def metrics(self) -> dict[str, float]:
        """The learned temperature (and SigLIP's bias)."""
        return dict(self._last)

    def state_dict(self) -> dict:
        """Batches consumed (the stream restarts at that pair)."""
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        """Resume after ``state['batches']`` batches."""
        self.batches, self._stream = int(state["batches"]), None

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Recall@1/@5 image→text and text→image on the held-out pairs."""
        pairs = list(itertools.islice(pair_stream(self.data, "val"), self.data.val_size))
        return evaluate_retrieval(
            model, pairs, self.tokenizer, self.image_size, self.context_length
        )


def _draw_pairs(job: tuple[tuple[int, int, int, int], list[int]]) -> list[tuple[int, tuple]]:
    """Worker: (index, (preprocessed image, caption)) for procedural train scenes."""
    (seed, max_objects, render, size), indices = job
    scenes = ProceduralScenes(seed=seed, split="train", image_size=render, max_objects=max_objects)
    out = []
    for i in indices:
        s = scenes[i]
        out.append((i, (preprocess(s.image, size), s.caption)))
    return out


@torch.no_grad()
def evaluate_retrieval(
    model: nn.Module,
    pairs: list[tuple[Any, str]],
    tokenizer: WordTokenizer,
    image_size: int,
    context_length: int,
    batch_size: int = 256,
) -> dict[str, float]:
    """Zero-shot retrieval recall@{1,5} both ways over ``pairs`` (chance: k / len(pairs))."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    img_feats, txt_feats = [], []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        images = torch.stack([preprocess(img, image_size) for img, _ in chunk]).to(device)
        tokens = encode_batch(tokenizer, [c for _, c in chunk], context_length).to(device)
        img_feats.append(model.encode_image(images))
        txt_feats.append(model.encode_text(tokens))
    model.train(was_training)
    out = retrieval_recall(torch.cat(img_feats), torch.cat(txt_feats))
    out["n"] = float(len(pairs))
    return out


def build_dual_encoder(cfg: ContrastiveRunConfig, tokenizer: WordTokenizer) -> DualEncoder:
    """The dual encoder for ``cfg`` (weights drawn from the current torch seed)."""
    return DualEncoder(
        cfg.vision,
        cfg.text,
        tokenizer.vocab_size,
        tokenizer.eos_id,
        cfg.joint.embed_dim,
        cfg.train.loss,
    )


def pick_device(device: str) -> str:
    """``auto`` → cuda when available, else cpu; anything else is checked by lmforge's runtime."""
    from lmforge.utils.runtime import resolve_device

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


RECALL_KEYS = ("i2t@1", "i2t@5", "t2i@1", "t2i@5", "n")
"what :func:`evaluate_retrieval` returns"


def pretrain(cfg: ContrastiveRunConfig, log: Callable[[dict], None] = print) -> dict[str, float]:
    """Run contrastive pretraining in the Trainer; returns the final recall.

    ``cfg.train.out`` holds config.toml (this config), vocab.json, results.json and ``train/``:
    the Trainer's folder (metrics.jsonl with the periodic retrieval evaluations, loss_curve.png,
    ``checkpoints/step_*``); a rerun resumes from its latest checkpoint.
    """
    from lmforge.utils.io import atomic_write_text
    from lmforge.vision._train import phase_train_config, run_phase

    t = cfg.train
    out = Path(t.out)
    tokenizer = build_tokenizer(cfg.data)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.toml")
    tokenizer.save(out / "vocab.json")
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    device = pick_device(t.device)
    model = build_dual_encoder(cfg, tokenizer)
    objective = ContrastiveObjective(
        cfg.data, tokenizer, cfg.vision.image_size, cfg.text.context_length, t.batch_size, t.loss
    )
    n_params = sum(p.numel() for p in model.parameters())
    log({"params": n_params, "vocab": tokenizer.vocab_size, "loss": t.loss, "device": str(device)})
    # CLIP's AdamW: β2 0.98, ε 1e-6 (the Trainer's groups decay matrices, not gains or biases)
    train = phase_train_config(
        out / "train",
        steps=t.steps,
        lr=t.lr,
        warmup=t.warmup,
        batch_size=t.batch_size,
        device=device,
        seed=t.seed,
        weight_decay=t.weight_decay,
        betas=(0.9, 0.98),
        eps=1e-6,
        grad_clip=t.grad_clip,
        eval_every=t.eval_every,
        save_every=t.save_every,
    )
    final = run_phase(objective, model, train, log)
    result = {k: float(final[k]) for k in RECALL_KEYS}
    log({"step": t.steps, **result})
    atomic_write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
    return result
