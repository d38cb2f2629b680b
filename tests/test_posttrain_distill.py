"""Distillation: corpus and on-policy runs shrink the divergence; vocabularies must match."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.core import Example, collate
from lmforge.posttrain.distill import DistillConfig, distill_loss, train_distill
from lmforge.utils.errors import LmforgeError


def _lm(vocab: int, d: int, layers: int, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=vocab, context_length=32, d_model=d,
                                     n_layers=layers, n_heads=2))  # fmt: skip


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_corpus_distillation_reduces_divergence(kind: str) -> None:
    teacher, student = _lm(20, 48, 2, 0), _lm(20, 32, 1, 1)
    g = torch.Generator().manual_seed(0)
    corpus = [
        Example(torch.randint(0, 20, (10,), generator=g).tolist(), [True] * 10) for _ in range(32)
    ]
    cfg = DistillConfig(loss=kind, temperature=2.0, steps=12, batch_size=8, lr=2e-2)
    probe = collate(corpus)
    before = float(distill_loss(student, teacher, probe, cfg))
    train_distill(student, teacher, cfg, corpus=corpus, progress=False)
    after = float(distill_loss(student, teacher, probe, cfg))
    assert after < 0.7 * before


def test_on_policy_distillation_runs_and_reduces_divergence() -> None:
    teacher, student = _lm(20, 48, 2, 0), _lm(20, 32, 1, 1)
    g = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(2, 20, (3,), generator=g).tolist() for _ in range(n)]

    cfg = DistillConfig(loss="reverse", steps=12, batch_size=8, lr=2e-2, max_tokens=4)
    hist = train_distill(student, teacher, cfg, prompts=prompts, progress=False)
    assert sum(h["loss"] for h in hist[-3:]) < sum(h["loss"] for h in hist[:3])


def test_vocabulary_mismatch_is_one_line_error() -> None:
    with pytest.raises(LmforgeError, match="vocabulary"):
        train_distill(_lm(20, 32, 1, 0), _lm(24, 32, 1, 0), DistillConfig(steps=1),
                      corpus=[Example([1, 2, 3], [True] * 3)], progress=False)  # fmt: skip
