"""Distillation in the Trainer: corpus and on-policy (samples from the serving engine) runs shrink
the divergence; vocabularies must match."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.config import DistillConfig
from lmforge.posttrain.core import Example, collate
from lmforge.posttrain.distill import DistillObjective, check_vocabularies, distill_loss
from lmforge.train import TrainConfig, Trainer
from lmforge.train.metrics import read_metrics
from lmforge.utils.errors import LmforgeError


def _lm(vocab: int, d: int, layers: int, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=vocab, context_length=32, d_model=d,
                                     n_layers=layers, n_heads=2))  # fmt: skip


def _run(tmp: Path, student: TransformerLM, obj: DistillObjective, steps: int) -> list[float]:
    tc = TrainConfig(out_dir=str(tmp), device="cpu", precision="fp32", batch_size=8,
                     max_steps=steps, lr=2e-2, min_lr=0.0, schedule="constant", warmup_steps=0,
                     weight_decay=0.0, eval_every=0, save_every=0, log_every=1, plot=False,
                     progress=False)  # fmt: skip
    Trainer(RunConfig(train=tc), model=student, objective=obj).run()
    return [r["loss"] for r in read_metrics(tmp / "metrics.jsonl") if r["event"] == "train"]


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_corpus_distillation_reduces_divergence(tmp_path: Path, kind: str) -> None:
    teacher, student = _lm(20, 48, 2, 0), _lm(20, 32, 1, 1)
    g = torch.Generator().manual_seed(0)
    corpus = [
        Example(torch.randint(0, 20, (10,), generator=g).tolist(), [True] * 10) for _ in range(32)
    ]
    cfg = DistillConfig(loss=kind, temperature=2.0)
    probe = collate(corpus)

    def mean(model: TransformerLM) -> float:
        total, n = distill_loss(model, teacher, probe, cfg)
        return float(total.detach() / n)

    before = mean(student)
    _run(tmp_path, student, DistillObjective(teacher, cfg, 8, corpus=corpus), 12)
    assert mean(student) < 0.7 * before


def test_on_policy_distillation_runs_and_reduces_divergence(tmp_path: Path) -> None:
    teacher, student = _lm(20, 48, 2, 0), _lm(20, 32, 1, 1)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 20) for _ in range(3)] for _ in range(16)]
    cfg = DistillConfig(loss="reverse", max_tokens=4)
    obj = DistillObjective(teacher, cfg, 8, prompts=prompts, eos_ids=[1])
    hist = _run(tmp_path, student, obj, 12)
    assert sum(hist[-3:]) < sum(hist[:3])


def test_vocabulary_mismatch_is_one_line_error() -> None:
    with pytest.raises(LmforgeError, match="vocabulary"):
        check_vocabularies(_lm(20, 32, 1, 0), _lm(24, 32, 1, 0))
