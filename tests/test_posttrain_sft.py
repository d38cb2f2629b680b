"""SFT: packing is exact (same per-token losses and gradients as one by one); the loop learns."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.config import SFTConfig
from lmforge.posttrain.core import Example, collate, sequence_logprobs
from lmforge.posttrain.packing import pack
from lmforge.posttrain.sft import SFTObjective, examples_from_records
from lmforge.posttrain.tasks import CharTokenizer
from lmforge.train import TrainConfig, Trainer
from lmforge.train.metrics import read_metrics
from lmforge.utils.errors import LmforgeError


def _examples(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        toks = torch.randint(2, vocab, (n,), generator=g).tolist()
        out.append(Example(toks, [False] * 2 + [True] * (n - 2)))
    return out


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def sft_loss(model: torch.nn.Module, mb: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    obj = SFTObjective([Example([1, 2], [False, True])], SFTConfig(), 1, "cpu")
    return obj.loss(model, mb)


def _check_packing(model: torch.nn.Module, exs: list[Example]) -> None:
    batch, packed = pack(exs, max_len=16)
    assert batch.input_ids.shape[0] < len(exs)  # it really packed
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels, attention=packed)
    for k, ex in enumerate(exs):
        one = collate([ex])
        ref, _ = sequence_logprobs(model, one.input_ids, one.labels)
        got = logp[(packed.index == k) & batch.mask]
        torch.testing.assert_close(got, ref[one.mask], atol=1e-5, rtol=1e-5)
    model.zero_grad()
    loss_sum, _ = sft_loss(model, (batch, packed))
    loss_sum.backward()
    packed_grad = _grads(model).clone()
    model.zero_grad()
    for ex in exs:
        one = collate([ex])
        loss_sum, _ = sft_loss(model, (one, None))
        loss_sum.backward()
    torch.testing.assert_close(packed_grad, _grads(model), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_packing_equals_one_by_one_lmforge(attention: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, context_length=32, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, attention=attention)  # fmt: skip
    _check_packing(TransformerLM(cfg), _examples(40, (5, 9, 4, 7, 3)))


@pytest.mark.requires("transformers")
def test_packing_equals_one_by_one_transformers_gpt2() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=1, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0)  # fmt: skip
    _check_packing(transformers.GPT2LMHeadModel(cfg), _examples(40, (5, 9, 4, 7, 3)))


def test_sft_objective_learns_in_the_trainer_and_validates_records(tmp_path) -> None:
    tok = CharTokenizer()
    recs = [{"prompt": f"{a}+{a}=", "response": str(2 * a)} for a in range(10)]
    exs = examples_from_records(recs, tok, chat=False, eos_id=tok.eos_id)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32,
                                      n_layers=1, n_heads=2))  # fmt: skip
    tc = TrainConfig(out_dir=str(tmp_path), device="cpu", precision="fp32", batch_size=5,
                     grad_accum=2, max_steps=40, lr=3e-3, min_lr=0.0, schedule="constant",
                     warmup_steps=0, weight_decay=0.0, eval_every=0, save_every=0, log_every=1,
                     plot=False, progress=False)  # fmt: skip
    obj = SFTObjective(exs, SFTConfig(max_len=32), 5, "cpu")
    Trainer(RunConfig(train=tc), model=model, objective=obj).run()
    hist = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    with pytest.raises(LmforgeError, match="record 1"):
        examples_from_records([{"text": "x"}], tok)
