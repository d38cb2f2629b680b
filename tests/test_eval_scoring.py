"""Log-likelihood scoring against a brute-force full forward, rolling windows, perplexity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.eval import (
    conditional_perplexity,
    perplexity,
    rolling_windows,
    score_continuations,
    score_sequences,
)
from lmforge.eval.scoring import encode_pair
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer


def _byte_tokenizer() -> Tokenizer:
    vocab = {**{i: bytes([i]) for i in range(256)}, 256: b"th", 257: b"the"}
    return Tokenizer(vocab, [(b"t", b"h"), (b"th", b"e")], ["<|endoftext|>"])


def _model(vocab: int = 259, context: int = 16, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab, context_length=context, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


def _brute(model: TransformerLM, tokens: list[int], n: int) -> list[float]:
    """log p of the last n tokens from one unbatched full forward (no windowing)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0].double()  # (T, V)
    logp = torch.log_softmax(logits, -1)
    t = len(tokens) - 1
    return [float(logp[p, tokens[p + 1]]) for p in range(t - n, t)]


def test_score_sequences_matches_full_forward_for_any_batching() -> None:
    model = _model()
    g = torch.Generator().manual_seed(0)
    items = []
    for length, n in [(5, 2), (17, 16), (9, 1), (12, 11), (3, 2)]:
        items.append((torch.randint(0, 259, (length,), generator=g).tolist(), n))
    expected = [_brute(model, toks, n) for toks, n in items]
    for bs in (1, 2, 8):
        got = score_sequences(model, items, batch_size=bs)
        for (lp, _), want in zip(got, expected):
            assert lp == pytest.approx(want, abs=1e-4)


def test_score_continuations_greedy_flag_and_truncation() -> None:
    model = _model()
    ctx = [1, 2, 3, 4]
    with torch.no_grad():
        greedy_next = int(model(torch.tensor([ctx]))[0, -1].argmax())
    other = (greedy_next + 1) % 259
    (ll_g, is_g), (ll_o, is_o) = score_continuations(model, [(ctx, [greedy_next]), (ctx, [other])])
    assert is_g and not is_o and ll_g > ll_o
    # longer than the context (16): the left of the context is dropped, the continuation kept
    long_ctx = list(range(40))
    ((ll, _),) = score_continuations(model, [(long_ctx, [7, 8])])
    assert ll == pytest.approx(math.fsum(_brute(model, [*long_ctx, 7, 8][-17:], 2)), abs=1e-4)
    with pytest.raises(ValueError, match="empty context"):
        score_continuations(model, [([], [1])])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 12), st.data())
def test_rolling_windows_score_every_token_once(n: int, max_len: int, data: st.DataObject) -> None:
    stride = data.draw(st.one_of(st.none(), st.integers(1, max_len)))
    windows = rolling_windows(n, max_len, stride)
    scored = [j for _, a, b in windows for j in range(a, b)]
    assert scored == list(range(1, n + 1))
    for lo, a, b in windows:
        assert 0 <= lo < a and b - 1 - lo <= max_len  # at most max_len inputs
        assert lo == max(0, b - 1 - max_len)  # as much context as fits
        if stride is not None and a > 1:
            assert a - 1 - lo >= min(max_len - stride, a - 1)


def test_perplexity_and_bits_per_byte() -> None:
    tok = _byte_tokenizer()
    model = _model(context=8)
    text = "the cat sat on the mat, and then the dog."
    res = perplexity(model, tok, [text], batch_size=3)
    ids = [tok.eot_id, *tok.encode(text)]
    # brute force with the same windows: every token scored once
    nll = 0.0
    for lo, a, b in rolling_windows(len(ids) - 1, 8):
        nll -= math.fsum(_brute(model, ids[lo:b], b - a))
    assert res.tokens == len(ids) - 1
    assert res.bytes == len(text.encode())
    assert res.nll == pytest.approx(nll, rel=1e-5)
    assert res.bits_per_byte == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-5)
    assert res.perplexity == pytest.approx(math.exp(nll / res.tokens), rel=1e-5)
    # a smaller stride gives more context per token; same token count
    res2 = perplexity(model, tok, [text], stride=2)
    assert res2.tokens == res.tokens and res2.nll != pytest.approx(res.nll)
    capped = perplexity(model, tok, [text], max_tokens=5)
    assert capped.tokens == 5 and capped.bytes == len(tok.decode(tok.encode(text)[:5]).encode())


def test_conditional_perplexity_scores_only_the_response() -> None:
    tok = _byte_tokenizer()
    model = _model()
    pairs = [("Q: 2+2?\nA:", " 4"), ("Hi ", "there")]
    res = conditional_perplexity(model, tok, pairs)
    expected_nll = 0.0
    for prompt, response in pairs:
        ctx, cont = encode_pair(tok, prompt, response)
        expected_nll -= math.fsum(_brute(model, [*ctx, *cont], len(cont)))
    assert res.nll == pytest.approx(expected_nll, rel=1e-5)
    assert res.tokens == len(tok.encode(" 4")) + len(tok.encode(" there"))
    assert res.bytes == len(" 4") + len("there")


def test_encode_pair_moves_trailing_space() -> None:
    tok = _byte_tokenizer()
    ctx, cont = encode_pair(tok, "Answer: ", "the")
    assert ctx == [tok.eot_id, *tok.encode("Answer:")] and cont == tok.encode(" the")
