"""A LLaVA-style vision-language model on an lmforge ``TransformerLM``.

The ViT's patch features (B, N, Dv) go through a 2-layer MLP projector to N "image tokens" of
the LM's width; the prompt holds N copies of the ``<image>`` id where the image goes, and those
rows of the LM's input embeddings are replaced by the projected features (``masked_scatter``, in
order). The LM's own ``forward`` then runs every layer (the one-forward rule): the spliced
embeddings enter through ``TransformerLM.forward(idx, input_embeds=...)``.

Shape legend: B batch, T tokens, N image tokens per image, D LM width, Dv ViT width.
Exercised by ``pytest tests/test_vision_vlm.py``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.layers import Linear
from lmforge.vision.data import WordTokenizer, preprocess
from lmforge.vision.encoders import ViT
from lmforge.vision.mrope import mrope_positions_batch
from lmforge.vision.scenes import QA, ProceduralScenes, SceneSample


def splice_image_embeds(
    token_embeds: torch.Tensor, tokens: torch.Tensor, image_embeds: torch.Tensor, image_id: int
) -> torch.Tensor:
    """Replace the rows of ``token_embeds`` (B, T, D) at ``tokens == image_id`` by the rows of
    ``image_embeds`` (M, N, D), in order (image m fills the m-th run of N placeholders)."""
    mask = tokens == image_id  # (B, T)
    n_slots, n_rows = int(mask.sum()), image_embeds.shape[0] * image_embeds.shape[1]
    if n_slots != n_rows:
        raise ValueError(
            f"the prompt has {n_slots} <image> slots but {n_rows} image embeddings were given"
        )
    source = image_embeds.to(token_embeds.dtype)
    return token_embeds.masked_scatter(mask.unsqueeze(-1), source)  # (B, T, D)


def lm_forward_with_embeds(
    lm: nn.Module,
    tokens: torch.Tensor,
    input_embeds: torch.Tensor,
    token_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``lm(tokens)`` with ``input_embeds`` (B, T, D) in place of the token-embedding lookup:
    the LM's own forward runs every layer (``TransformerLM.forward(..., input_embeds=)``);
    ``token_positions`` as there (an MRoPE LM's (3, B, T))."""
    return lm(tokens, token_positions, input_embeds=input_embeds)


class Projector(nn.Module):
    """LLaVA-1.5's projector: Linear → GELU → Linear, ViT width to LM width."""

    def __init__(self, d_vision: int, d_model: int) -> None:
        super().__init__()
        self.fc1 = Linear(d_vision, d_model)
        self.fc2 = Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., Dv) -> (..., D)."""
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLanguageModel(nn.Module):
    """ViT → projector → image tokens spliced into a ``TransformerLM`` at ``<image>`` slots."""

    def __init__(self, vision: ViT, lm: nn.Module, image_id: int) -> None:
        super().__init__()
        self.vision, self.lm, self.image_id = vision, lm, image_id
        self.projector = Projector(vision.config.d_model, lm.config.d_model)

    @property
    def n_image_tokens(self) -> int:
        """Placeholders one image fills (N = the ViT's patch count)."""
        return self.vision.config.n_patches

    @property
    def grid_hw(self) -> tuple[int, int]:
        """The patch grid (rows, cols) of one image: its N tokens in row-major order."""
        g = self.vision.config.image_size // self.vision.config.patch_size
        return g, g

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels -> (B, N, D) image tokens."""
        return self.projector(self.vision(images)[1])

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of ``tokens`` (B, T) with N ``<image>`` slots per image in
        ``images`` (M, 3, S, S); without images the plain LM. An MRoPE LM
        (``lm.config.mrope_sections``) gets Qwen2-VL's 3-vector positions: each image on its
        patch grid, the text after it continuing from the grid's largest position + 1."""
        if images is None:
            return self.lm(tokens)
        embeds = self.lm.token_embeddings(tokens)  # (B, T, D)
        embeds = splice_image_embeds(embeds, tokens, self.image_embeds(images), self.image_id)
        positions = None
        if self.lm.config.mrope_sections:
            positions = mrope_positions_batch(tokens, self.image_id, self.grid_hw)  # (3, B, T)
        return lm_forward_with_embeds(self.lm, tokens, embeds, positions)


def choose_question(sample: SceneSample, key: str) -> QA:
    """One question of the scene, its kind drawn uniformly among the kinds the scene offers (so
    count questions, present in every scene, do not dominate)."""
    rng = random.Random(key)
    kinds = sorted({q.kind for q in sample.qa})
    kind = rng.choice(kinds)
    return rng.choice([q for q in sample.qa if q.kind == kind])


def build_example(
    tok: WordTokenizer, n_image: int, context: str, target: str, sample: SceneSample, qa: QA | None
) -> tuple[list[int], list[bool]]:
    """Token ids and the loss mask (True = predicted) of one training/eval sequence.

    ``context``: ``image`` (N ``<image>`` slots), ``caption`` (the caption's words) or ``none``.
    ``target``: ``caption`` (the caption follows the context) or ``answer`` (the question
    follows, then the answer). The loss covers the target words and the closing EOS.
    """
    ids = [tok.bos_id]
    if context == "image":
        ids += [tok.image_id] * n_image
    elif context == "caption":
        ids += tok.encode(sample.caption)
    if target == "caption":
        answer = tok.encode(sample.caption)
    else:
        assert qa is not None
        ids += tok.encode(qa.question)
        answer = tok.encode(qa.answer)
    mask = [False] * len(ids) + [True] * (len(answer) + 1)
    return ids + answer + [tok.eos_id], mask


def collate(
    examples: list[tuple[list[int], list[bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (B, T), targets (B, T)) for next-token prediction; targets are -100 where the
    loss mask is off (padding included)."""
    t = max(len(ids) for ids, _ in examples) - 1
    inputs = torch.full((len(examples), t), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), t), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        x = torch.tensor(ids)
        inputs[i, : len(ids) - 1] = x[:-1]
        keep = torch.tensor(mask[1:])
        targets[i, : len(ids) - 1] = torch.where(keep, x[1:], torch.tensor(-100))
    return inputs, targets


class VLMObjective:
    """Next-token loss on procedural scenes for one VLM phase, an objective of the one Trainer:
    ``context`` image / caption / none, ``target`` caption (stage 1) or answer (stage 2 and the
    text baselines). ``loss`` returns (summed token losses, number of target tokens). With
    ``bf16`` the forward runs under bf16 autocast (fp32 weights and AdamW state; CUDA); the
    loss is taken in fp32. Which parameters train is the model's ``requires_grad``: stage 1
    freezes the ViT and the LM, stage 2 the ViT."""

    def __init__(
        self,
        scenes: ProceduralScenes,
        tokenizer: WordTokenizer,
        n_image_tokens: int,
        batch_size: int,
        context: str,
        target: str,
        name: str = "vlm",
        bf16: bool = False,
    ) -> None:
        self.scenes, self.tok, self.n_image = scenes, tokenizer, n_image_tokens
        self.batch_size, self.context, self.target, self.name = batch_size, context, target, name
        self.bf16 = bf16
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs (B, T), targets (B, T), images (B, 3, S, S) or None)."""
        samples = [self.scenes[self.position + i] for i in range(self.batch_size)]
        keys = [f"qa:{self.scenes.split}:{self.position + i}" for i in range(self.batch_size)]
        self.position += self.batch_size
        qas = [choose_question(s, k) for s, k in zip(samples, keys, strict=True)]
        examples = [
            build_example(self.tok, self.n_image, self.context, self.target, s, q)
            for s, q in zip(samples, qas, strict=True)
        ]
        inputs, targets = collate(examples, self.tok.pad_id)
        images = None
        if self.context == "image":
            images = torch.stack([preprocess(s.image, self.scenes.image_size) for s in samples])
        return inputs, targets, images

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of target-token cross-entropies, number of target tokens)."""
        device = next(model.parameters()).device
        weight = (batch[1] != -100).sum()  # counted where the batch is (the host): no sync
        inputs, targets, images = (None if t is None else t.to(device) for t in batch)
        with torch.autocast(device.type, torch.bfloat16, enabled=self.bf16):
            logits = model(inputs) if images is None else model(inputs, images)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss, weight

    def batch_weight(self, batch: Any) -> float:
        """Target tokens of the batch (counted on the host: no device sync)."""
        return float((batch[1] != -100).sum())

    def state_dict(self) -> dict:
        """Scenes consumed."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state['position']`` scenes."""
        self.position = int(state["position"])


@torch.no_grad()
def question_accuracy(
    model: nn.Module,
    scenes: ProceduralScenes,
    tokenizer: WordTokenizer,
    context: str,
    n_image_tokens: int,
    n_scenes: int = 200,
    batch_size: int = 64,
) -> dict[str, float]:
    """Exact-match answer accuracy per question kind over every question of ``n_scenes`` scenes.

    An answer counts when the argmax at every answer position is the answer's word given the
    true prefix — the same as greedy decoding the answer exactly (each greedy step sees the
    prefix it produced, which is then the true one). ``acc`` is the mean over the four kinds.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    items = [(scenes[i], q) for i in range(n_scenes) for q in scenes[i].qa]
    hits: dict[str, list[float]] = {}
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        examples = [
            build_example(tokenizer, n_image_tokens, context, "answer", s, q) for s, q in chunk
        ]
        inputs, targets = collate(examples, tokenizer.pad_id)
        images = None
        if context == "image":
            images = torch.stack([preprocess(s.image, scenes.image_size) for s, _ in chunk]).to(
                device
            )
        inputs, targets = inputs.to(device), targets.to(device)
        logits = model(inputs) if images is None else model(inputs, images)  # (B, T, V)
        checked = targets != -100
        checked &= targets != tokenizer.eos_id  # the answer words; the EOS is not part of it
        right = ((logits.argmax(-1) == targets) | ~checked).all(1)  # (B,)
        for (_, q), ok in zip(chunk, right.tolist(), strict=True):
            hits.setdefault(q.kind, []).append(float(ok))
    model.train(was_training)
    out = {f"acc_{k}": float(np.mean(v)) for k, v in sorted(hits.items())}
    out["acc"] = float(np.mean([out[f"acc_{k}"] for k in hits]))
    return out
