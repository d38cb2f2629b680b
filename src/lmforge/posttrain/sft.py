"""Supervised fine-tuning: conversations or prompt/response pairs, loss on assistant tokens only,
optionally packed without cross-attention (:mod:`lmforge.posttrain.packing`).

Data: JSONL records, either ``{"messages": [{"role", "content"}, ...]}`` (rendered with the
tokenizer's chat template or ChatML) or ``{"prompt": ..., "response": ...}`` (prompt through the
chat template when ``chat`` is on, raw otherwise). Loss: token-level mean over every assistant
token of the optimizer step (:func:`~lmforge.posttrain.core.accumulate_step`).
Exercised by ``pytest tests/test_posttrain_sft.py`` and ``lmforge sft --help``.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.chat import chat_example, prompt_text
from lmforge.posttrain.core import (
    Batch,
    Example,
    accumulate_step,
    collate,
    encode_text,
    prompt_response_example,
    sequence_logprobs,
)
from lmforge.posttrain.packing import Packed, pack
from lmforge.utils.errors import LmforgeError


def examples_from_records(
    records: Sequence[dict[str, Any]], tokenizer: Any, chat: bool = True, eos_id: int | None = None,
    where: str = "data",
) -> list[Example]:  # fmt: skip
    """Tokenized :class:`Example` per record (``messages`` or ``prompt``/``response``)."""
    out = []
    for n, rec in enumerate(records, start=1):
        here = f"{where} record {n}"
        if "messages" in rec:
            out.append(chat_example(tokenizer, rec["messages"], here))
        elif "prompt" in rec and "response" in rec:
            if not isinstance(rec["prompt"], str) or not isinstance(rec["response"], str):
                raise LmforgeError(f"{here}: 'prompt' and 'response' must be strings")
            p = encode_text(tokenizer, prompt_text(tokenizer, rec["prompt"], chat))
            r = encode_text(tokenizer, rec["response"])
            out.append(prompt_response_example(p, r, eos_id))
        else:
            raise LmforgeError(f"{here}: expected 'messages' or 'prompt' and 'response'")
    return out


def sft_loss(model: nn.Module, mb: tuple[Batch, Packed | None]) -> tuple[torch.Tensor, float]:
    """Token-level SFT loss of a micro-batch: (sum of −log p over target tokens, their count)."""
    batch, packed = mb
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels, attention=packed)
    return -(logp * batch.mask).sum(), float(batch.mask.sum())


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT hyperparameters."""

    steps: int = 100
    "optimizer steps"
    batch_size: int = 16
    "examples per optimizer step"
    micro_batch: int = 4
    "examples per forward/backward (gradient accumulation over the rest)"
    lr: float = 2e-5
    "AdamW learning rate (constant after a 10-step warm-up)"
    max_len: int = 1024
    "longest (packed) sequence"
    packing: bool = True
    "pack several examples per row without cross-attention"
    max_grad_norm: float = 1.0
    "gradient clipping"
    seed: int = 0
    "shuffling seed"


def sft_micro_batches(
    examples: Sequence[Example], cfg: SFTConfig, pad_id: int, device: torch.device
) -> list[tuple[Batch, Packed | None]]:
    """The micro-batches of one optimizer step's examples."""
    out: list[tuple[Batch, Packed | None]] = []
    for i in range(0, len(examples), cfg.micro_batch):
        chunk = examples[i : i + cfg.micro_batch]
        if cfg.packing:
            b, p = pack(chunk, cfg.max_len, pad_id)
            out.append((b.to(device), p.to(device)))
        else:
            out.append((collate(chunk, pad_id, cfg.max_len).to(device), None))
    return out


def train_sft(
    model: nn.Module,
    examples: Sequence[Example],
    cfg: SFTConfig,
    pad_id: int = 0,
    log_path: str | Path | None = None,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Fine-tune ``model`` in place; returns the per-step metrics (also appended to ``log_path``)."""
    from tqdm import tqdm

    if not examples:
        raise LmforgeError("no SFT examples")
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    rng = random.Random(cfg.seed)
    order: list[int] = []
    history = []
    model.train()
    for step in tqdm(range(1, cfg.steps + 1), desc="sft", disable=not progress):
        chosen = []
        for _ in range(cfg.batch_size):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            chosen.append(examples[order.pop()])
        mbs = sft_micro_batches(chosen, cfg, pad_id, device)
        weights = [float(b.mask.sum()) for b, _ in mbs]
        stats = accumulate_step(model, opt, mbs, sft_loss, cfg.max_grad_norm, weights)
        sched.step()
        rec = {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
               "tokens": stats["weight"]}  # fmt: skip
        history.append(rec)
        if log_path is not None:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
    model.eval()
    return history
