"""Supervised fine-tuning: conversations or prompt/response pairs, loss on assistant tokens only,
optionally packed without cross-attention (:mod:`lmforge.posttrain.packing`).

Data: JSONL records, either ``{"messages": [{"role", "content"}, ...]}`` (rendered with the
tokenizer's chat template or ChatML) or ``{"prompt": ..., "response": ...}`` (prompt through the
chat template when ``chat`` is on, raw otherwise).
Exercised by ``pytest tests/test_posttrain_sft.py`` and ``lmforge sft --help``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.chat import chat_example, prompt_text
from lmforge.posttrain.config import SFTConfig
from lmforge.posttrain.core import (
    Batch,
    Example,
    collate,
    encode_text,
    prompt_response_example,
    sequence_logprobs,
    set_random_state,
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


class SFTObjective:
    """SFT as a :class:`~lmforge.train.Objective`: ``batch_size`` examples per micro-batch in an
    order reshuffled every pass, packed or padded. Loss: the sum of −log p over target tokens,
    weighted by their count, so a step's loss is the token-level mean over its micro-batches."""

    name = "sft"

    def __init__(
        self,
        examples: Sequence[Example],
        cfg: SFTConfig,
        batch_size: int,
        device: torch.device | str,
        seed: int = 0,
        pad_id: int = 0,
    ) -> None:
        if not examples:
            raise LmforgeError("no SFT examples")
        self.examples = list(examples)
        self.cfg = cfg
        self.batch_size = batch_size
        self.device = device
        self.pad_id = pad_id
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self._tokens = 0.0

    def next_batch(self) -> tuple[Batch, Packed | None]:
        """The next ``batch_size`` examples as one micro-batch on the device."""
        chosen = []
        for _ in range(self.batch_size):
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            chosen.append(self.examples[self.order.pop()])
        if self.cfg.packing:
            b, p = pack(chosen, self.cfg.max_len, self.pad_id)
            return b.to(self.device), p.to(self.device)
        return collate(chosen, self.pad_id, self.cfg.max_len).to(self.device), None

    def batch_weight(self, mb: tuple[Batch, Packed | None]) -> float:
        """Target tokens of the micro-batch."""
        return float(mb[0].mask.sum())

    def loss(
        self, model: nn.Module, mb: tuple[Batch, Packed | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of −log p over target tokens, their count)."""
        batch, packed = mb
        logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels, attention=packed)
        mask = batch.mask
        self._tokens += float(mask.sum())
        return -(logp * mask).sum(), mask.sum().float()

    def metrics(self) -> dict[str, float]:
        """Target tokens of the last step."""
        out, self._tokens = {"tokens": self._tokens}, 0.0
        return out

    def state_dict(self) -> dict:
        """Shuffle RNG and the rest of this pass's order."""
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        set_random_state(self.rng, state["rng"])
        self.order = list(state["order"])
