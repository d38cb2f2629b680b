"""Post-training building blocks against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.chat import chat_example, render_chatml
from lmforge.posttrain.core import (
    IGNORE,
    Example,
    accumulate_step,
    collate,
    masked_mean,
    masked_sum_normalize,
    masked_whiten,
    prompt_response_example,
    sequence_logprobs,
    token_entropy,
    token_logprobs,
)
from lmforge.posttrain.tasks import CharTokenizer
from lmforge.utils.errors import LmforgeError


def tiny_lm(vocab: int = 40, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, context_length=64, d_model=32, n_layers=2, n_heads=4)
    return TransformerLM(cfg)


def test_token_logprobs_match_float64_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 0] = IGNORE
    for temp in (1.0, 0.7, 0.0):
        t = 1.0 if temp == 0 else temp
        ref = torch.log_softmax(logits.double() / t, -1).gather(-1, labels.clamp_min(0)[..., None])
        ref = ref.squeeze(-1).masked_fill(labels == IGNORE, 0.0)
        got = token_logprobs(logits, labels, temp)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)


def test_token_entropy_reference() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = token_entropy(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(4), 0.0]]), atol=1e-5, rtol=0)


def test_masked_reductions() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, True, False], [False, False, True]])
    assert float(masked_mean(x, m)) == pytest.approx((1 + 2 + 6) / 3)
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 6.0]))
    assert float(masked_sum_normalize(x, m, 10.0)) == pytest.approx(0.9)
    torch.testing.assert_close(masked_sum_normalize(x, m, 2.0, dim=1), torch.tensor([1.5, 3.0]))
    w = masked_whiten(x, m)
    vals = torch.tensor([1.0, 2.0, 6.0])
    ref = (vals - vals.mean()) / vals.std()
    torch.testing.assert_close(w[m], ref, atol=1e-4, rtol=0)
    assert float(w[~m].abs().sum()) == 0.0


def test_prompt_response_masks_prompt_and_padding() -> None:
    ex = prompt_response_example([5, 6, 7], [8, 9], eos_id=1)
    assert ex.tokens == [5, 6, 7, 8, 9, 1]
    inputs, labels = ex.shifted()
    assert inputs == [5, 6, 7, 8, 9]
    assert labels == [IGNORE, IGNORE, 8, 9, 1]
    b = collate([ex, prompt_response_example([2], [3])], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [2, 0, 0, 0, 0]]
    assert b.labels.tolist() == [[IGNORE, IGNORE, 8, 9, 1], [3] + [IGNORE] * 4]
    with pytest.raises(LmforgeError):
        prompt_response_example([], [1])


def test_chatml_marks_assistant_turns_only() -> None:
    tok = CharTokenizer(alphabet="abcdefghijklmnopqrstuvwxyz<>|_\n ")
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "no"},
    ]
    ex = chat_example(tok, msgs)
    assert tok.decode(ex.tokens) == render_chatml(msgs, add_generation_prompt=False)
    trained = tok.decode([t for t, m in zip(ex.tokens, ex.trainable) if m])
    assert trained == "yo<|im_end|>\nno<|im_end|>\n"
    with pytest.raises(LmforgeError, match="role"):
        chat_example(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(LmforgeError, match="assistant"):
        chat_example(tok, [{"role": "user", "content": "x"}])


def test_chat_uses_the_tokenizers_own_template() -> None:
    class Tok:
        chat_template = "custom"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            s = "".join(f"[{m['role']}]{m['content']}." for m in messages)
            return s + ("[assistant]" if add_generation_prompt else "")

        def convert_tokens_to_ids(self, t):
            return 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    ex = chat_example(Tok(), msgs)
    assert "".join(chr(t) for t in ex.tokens) == "[user]q.[assistant]a."
    assert "".join(chr(t) for t, m in zip(ex.tokens, ex.trainable) if m) == "a."


@pytest.mark.parametrize("unit", ["token", "sequence"])
def test_accumulation_gradient_equals_full_batch(unit: str) -> None:
    """Σ loss_sum / Σ weight: the gradient of 3 uneven micro-batches equals the full batch's."""
    torch.manual_seed(1)
    exs = [
        prompt_response_example(
            torch.randint(2, 40, (3,)).tolist(), torch.randint(2, 40, (n,)).tolist()
        )
        for n in (1, 4, 2, 6, 3)
    ]

    def loss_fn(model, b):
        logp, _ = sequence_logprobs(model, b.input_ids, b.labels)
        if unit == "token":
            return -logp[b.mask].sum(), float(b.mask.sum())
        per_seq = -(logp * b.mask).sum(-1) / b.mask.sum(-1)
        return per_seq.sum(), float(len(per_seq))

    grads = []
    for split, known in (([5], False), ([1, 3, 1], False), ([1, 3, 1], True)):
        model = tiny_lm()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        chunks, i = [], 0
        for n in split:
            chunks.append(collate(exs[i : i + n]))
            i += n
        # weights up front: backward right after each forward (what SFT passes)
        weights = [loss_fn(model, c)[1] for c in chunks] if known else None
        stats = accumulate_step(model, opt, chunks, loss_fn, weights=weights)
        grads.append((torch.cat([p.grad.flatten() for p in model.parameters()]), stats["loss"]))
    for g, loss in grads[1:]:
        torch.testing.assert_close(grads[0][0], g, atol=1e-6, rtol=1e-5)
        assert grads[0][1] == pytest.approx(loss, rel=1e-5)


def test_works_on_a_transformers_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    b = collate([Example([3, 4, 5, 6], [False, False, True, True])])
    logp, ent = sequence_logprobs(model, b.input_ids, b.labels, with_entropy=True)
    ref = torch.log_softmax(model(b.input_ids).logits.double(), -1)
    assert float(logp[0, 2]) == pytest.approx(float(ref[0, 2, 6]), abs=1e-5)
    assert ent is not None and ent.shape == (1, 3)
