"""DPO family and the Bradley–Terry reward model on small synthetic preferences (and HH-RLHF parsing)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.dpo import (
    DPOConfig,
    RewardModel,
    hidden_size,
    pair_losses,
    reference_scores,
    split_pair,
    tokenize_pairs,
    train_dpo,
    train_reward_model,
)
from lmforge.posttrain.tasks import CharTokenizer, read_jsonl
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
    cfg = DPOConfig(loss=loss, beta=0.1 if loss != "simpo" else 2.0, batch_size=4)
    ref = reference_scores(model, pairs, cfg, 0)
    losses, rc, rr = pair_losses(model, pairs, ref, cfg, 0)
    if loss in ("dpo", "cdpo"):  # policy == reference: every pair at log 2
        torch.testing.assert_close(losses, torch.full((4,), math.log(2.0)))
    elif loss == "ipo":
        torch.testing.assert_close(losses, torch.full((4,), (1 / (2 * 0.1)) ** 2))
    if loss != "simpo":
        assert float((rc - rr).abs().max()) == 0.0


def test_dpo_raises_held_out_preference_accuracy() -> None:
    tok = CharTokenizer()
    model = _model(tok)
    train = tokenize_pairs(_pairs(64, 1), tok, 32, tok.eos_id)
    held = tokenize_pairs(_pairs(32, 2), tok, 32, tok.eos_id)
    out = train_dpo(model, train, held, DPOConfig(lr=3e-3, epochs=5, batch_size=8, beta=0.5),
                    progress=False)  # fmt: skip
    assert out["before"]["accuracy"] == 0.5  # policy == reference: all ties
    assert out["after"]["accuracy"] > 0.8
    assert out["history"][-1]["loss"] < out["history"][0]["loss"]


def test_reward_model_learns_pairs() -> None:
    tok = CharTokenizer()
    lm = _model(tok)
    rm = RewardModel(lm, hidden_size(lm))
    train = tokenize_pairs(_pairs(64, 1), tok, 32, tok.eos_id)
    held = tokenize_pairs(_pairs(32, 2), tok, 32, tok.eos_id)
    out = train_reward_model(rm, train, held, lr=3e-3, epochs=8, progress=False)
    assert out["after"] > 0.8 and out["after"] > out["before"]


def test_hh_rlhf_pairs_parse(shared_data) -> None:
    path = shared_data / "preference" / "harmless-base_test.jsonl.gz"
    if not path.is_file():
        pytest.skip("HH-RLHF pairs absent")
    recs = read_jsonl(path)[:50]
    for n, rec in enumerate(recs):
        p, c, r = split_pair(rec, f"record {n}")
        assert p.endswith("Assistant:") and p + c == rec["chosen"] and p + r == rec["rejected"]
