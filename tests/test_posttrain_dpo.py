"""DPO family and the Bradley–Terry reward model on small synthetic preferences (and HH-RLHF parsing)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.config import DPOConfig
from lmforge.posttrain.dpo import (
    DPOObjective,
    RewardModel,
    RewardModelObjective,
    hidden_size,
    pair_losses,
    reference_scores,
    split_pair,
    steps_per_epoch,
    tokenize_pairs,
)
from lmforge.posttrain.tasks import CharTokenizer, read_jsonl
from lmforge.train import TrainConfig, Trainer
from lmforge.train.metrics import read_metrics
from lmforge.utils.errors import LmforgeError


def _pairs(n: int, seed: int) -> list[dict[str, str]]:
    """Chosen replies repeat the prompt's first digit; rejected ones a different digit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        wrong = (a + 1 + rng.randrange(9)) % 10
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a) * 3, "rejected": str(wrong) * 3})
    return out


def _run(tmp, model, objective, steps: int, lr: float = 3e-3) -> dict:
    tc = TrainConfig(out_dir=str(tmp), device="cpu", precision="fp32", batch_size=8,
                     max_steps=steps, lr=lr, min_lr=0.0, schedule="constant", warmup_steps=0,
                     weight_decay=0.0, eval_every=0, save_every=0, log_every=1, plot=False,
                     progress=False)  # fmt: skip
    return Trainer(RunConfig(train=tc), model=model, objective=objective).run()


def _model(tok: CharTokenizer) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32,
                                     n_layers=1, n_heads=2))  # fmt: skip


def test_split_hh_rlhf_dialogue() -> None:
    rec = {
        "chosen": "\n\nHuman: hi\n\nAssistant: hello",
        "rejected": "\n\nHuman: hi\n\nAssistant: go",
    }
    assert split_pair(rec, "r") == ("\n\nHuman: hi\n\nAssistant:", " hello", " go")
    with pytest.raises(LmforgeError, match="chosen"):
        split_pair({"chosen": 1}, "r")


@pytest.mark.parametrize("loss", ["dpo", "ipo", "cdpo", "simpo"])
def test_preference_losses_start_where_theory_says(loss: str) -> None:
    tok = CharTokenizer()
    model = _model(tok)
    pairs = tokenize_pairs(_pairs(4, 0), tok, 32, tok.eos_id)
    cfg = DPOConfig(loss=loss, beta=0.1 if loss != "simpo" else 2.0)
    ref = reference_scores(model, pairs, cfg, 0)
    losses, rc, rr = pair_losses(model, pairs, ref, cfg, 0)
    if loss in ("dpo", "cdpo"):  # policy == reference: every pair at log 2
        torch.testing.assert_close(losses, torch.full((4,), math.log(2.0)))
    elif loss == "ipo":
        torch.testing.assert_close(losses, torch.full((4,), (1 / (2 * 0.1)) ** 2))
    if loss != "simpo":
        assert float((rc - rr).abs().max()) == 0.0


@pytest.mark.parametrize("reference", ["cached", "online"])
def test_dpo_raises_held_out_preference_accuracy(tmp_path, reference: str) -> None:
    tok = CharTokenizer()
    model = _model(tok)
    train = tokenize_pairs(_pairs(64, 1), tok, 32, tok.eos_id)
    held = tokenize_pairs(_pairs(32, 2), tok, 32, tok.eos_id)
    obj = DPOObjective(model, train, held, DPOConfig(beta=0.5, reference=reference), 8)
    before = obj.evaluate(model)
    assert before["eval_accuracy"] == 0.5  # policy == reference: all ties
    after = _run(tmp_path, model, obj, 5 * steps_per_epoch(len(train), 8))
    assert after["eval_accuracy"] > 0.8
    hist = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert hist[-1]["loss"] < hist[0]["loss"] and "reward_accuracy" in hist[0]


def test_reward_model_learns_pairs(tmp_path) -> None:
    tok = CharTokenizer()
    lm = _model(tok)
    rm = RewardModel(lm, hidden_size(lm))
    train = tokenize_pairs(_pairs(64, 1), tok, 32, tok.eos_id)
    held = tokenize_pairs(_pairs(32, 2), tok, 32, tok.eos_id)
    obj = RewardModelObjective(train, held, 8)
    before = obj.evaluate(rm)["eval_accuracy"]
    after = _run(tmp_path, rm, obj, 8 * steps_per_epoch(len(train), 8))["eval_accuracy"]
    assert after > 0.8 and after > before


def test_hh_rlhf_pairs_parse(shared_data) -> None:
    path = shared_data / "preference" / "harmless-base_test.jsonl.gz"
    if not path.is_file():
        pytest.skip("HH-RLHF pairs absent")
    recs = read_jsonl(path)[:50]
    for n, rec in enumerate(recs):
        p, c, r = split_pair(rec, f"record {n}")
        assert p.endswith("Assistant:") and p + c == rec["chosen"] and p + r == rec["rejected"]
