"""Multi-token prediction: shapes, the loss against a hand-written per-position reference,
gradients reaching the main model, and greedy drafts equal to the training-path argmax over the
sequence extended by the earlier drafts (through the main model itself, so causality holds)."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerBlock, TransformerLM
from lmforge.model.mtp import MTPDraft, MultiTokenPrediction, mtp_draft, mtp_loss
from lmforge.utils.errors import LmforgeError

V = 41
CFG = ModelConfig(vocab_size=V, context_length=64, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, attention="reference")  # fmt: skip


def _setup(depth: int = 2, seed: int = 0) -> tuple[TransformerLM, MultiTokenPrediction]:
    torch.manual_seed(seed)
    model = TransformerLM(CFG)
    mtp = MultiTokenPrediction(
        CFG.d_model, depth, lambda k: TransformerBlock(CFG, CFG.n_layers + k), CFG.norm_eps
    )
    with torch.no_grad():
        for p in mtp.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model, mtp


def test_shapes() -> None:
    model, mtp = _setup(depth=3)
    x = torch.randint(0, V, (2, 9))
    h = model.forward_hidden(x)
    logits = mtp(h, x, model.token_embeddings, model.logits_from_hidden)
    assert [tuple(t.shape) for t in logits] == [(2, 8, V), (2, 7, V), (2, 6, V)]
    short = mtp(h[:, :2], x[:, :2], model.token_embeddings, model.logits_from_hidden)
    assert len(short) == 1  # depths with nothing left to predict are left out


def _reference_loss(model, mtp, seq, weight):
    """Position by position: depth k at i sees h^{k-1}_{0..i} and t_{1+k-1..i+k}, scores t_{i+k+1}."""
    x, y = seq[:, :-1], seq[:, 1:]
    b, t = x.shape
    emb = model.token_embeddings
    h_prev = model.forward_hidden(x)  # (B, T, D)
    losses = []
    for k, m in enumerate(mtp.layers, start=1):
        n = t - k
        inp = torch.cat([m.enorm(emb(x[:, k:])), m.hnorm(h_prev[:, :n])], -1)
        h = m.block(inp @ m.proj.weight.T, torch.arange(n))
        total, count = 0.0, 0
        for bi in range(b):
            for i in range(n):
                logp = torch.log_softmax(model.lm_head.weight @ m.norm_out(h[bi, i]), -1)
                total = total - logp[y[bi, i + k]]
                count += 1
        losses.append(total / count)
        h_prev = h
    return weight * sum(losses) / len(losses), losses


def test_loss_equals_hand_written_reference() -> None:
    model, mtp = _setup(depth=2)
    seq = torch.randint(0, V, (2, 8))
    x, y = seq[:, :-1], seq[:, 1:]
    h = model.forward_hidden(x)
    loss, per_depth = mtp_loss(mtp, h, x, y, model.token_embeddings, model.logits_from_hidden, 0.3)
    want, want_depth = _reference_loss(model, mtp, seq, 0.3)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(per_depth, want_depth, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert 0.5 * math.log(V) < per_depth[0].item() < 2 * math.log(V)  # near-uniform at init


def test_ignore_index_and_gradients_reach_main_model() -> None:
    model, mtp = _setup(depth=2)
    seq = torch.randint(0, V, (2, 10))
    x, y = seq[:, :-1], seq[:, 1:].clone()
    y[0, 5:] = -100  # padding: depth k skips it at rows i >= 5 - k
    h = model.forward_hidden(x)
    loss, per = mtp_loss(mtp, h, x, y, model.token_embeddings, model.logits_from_hidden, 1.0)
    logits = mtp(h, x, model.token_embeddings, model.logits_from_hidden)
    keep = y[:, 1:] != -100
    want = torch.nn.functional.cross_entropy(logits[0][keep], y[:, 1:][keep])
    torch.testing.assert_close(per[0], want)
    loss.backward()
    for name in ("token_embeddings.weight", "layers.0.attn.q_proj.weight", "lm_head.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert all(p.grad is not None for p in mtp.parameters())


@pytest.mark.parametrize("k", [1, 2])
def test_drafts_equal_training_path_argmax(k: int) -> None:
    """Draft j = argmax of depth j's training-path logits at position n−1, the sequence being
    the tokens plus drafts 1..j−1 (the main model recomputed over it: causal, so position n−1
    is unchanged)."""
    model, mtp = _setup(depth=2, seed=3)
    model.eval()
    mtp.eval()
    tokens = torch.randint(0, V, (3, 7))  # n = 6 processed + the sampled 7th
    n = tokens.shape[1] - 1
    h = model.forward_hidden(tokens[:, :n])
    drafts = mtp_draft(mtp, h, tokens, k, model.token_embeddings, model.logits_from_hidden)
    assert drafts.shape == (3, k)
    seq = tokens
    for j in range(1, k + 1):
        with torch.no_grad():
            full = model.forward_hidden(seq)  # (B, n + j, D)
            logits = mtp(full, seq, model.token_embeddings, model.logits_from_hidden)
        want = logits[j - 1][:, n - 1].argmax(-1)  # depth j, position n − 1
        assert torch.equal(drafts[:, j - 1], want)
        seq = torch.cat([seq, want[:, None]], 1)


def test_draft_beyond_depth_reuses_last_module_and_proposer_api() -> None:
    model, mtp = _setup(depth=1, seed=4)
    tokens = torch.randint(0, V, (1, 6))
    h = model.forward_hidden(tokens[:, :5])
    d3 = mtp_draft(mtp, h, tokens, 3, model.token_embeddings, model.logits_from_hidden)
    # step-by-step: module 1 applied to its own output for drafts 2 and 3
    m = mtp.layers[0]
    seq, hh, want = tokens, h, []
    for j in range(1, 4):
        hh = m(hh, model.token_embeddings(seq[:, j : j + 5]), torch.arange(5))
        nxt = model.logits_from_hidden(m.norm_out(hh[:, -1])).argmax(-1)
        want.append(int(nxt))
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert d3[0].tolist() == want
    drafter = MTPDraft(mtp, model.token_embeddings, model.logits_from_hidden)
    assert drafter.propose(h[0], tokens[0].tolist(), 3) == want
    assert drafter.propose(h[0], tokens[0].tolist(), 0) == []


def test_bad_depth_is_one_line() -> None:
    with pytest.raises(LmforgeError, match="MTP depth must be an integer >= 1"):
        MultiTokenPrediction(8, 0, lambda k: torch.nn.Identity())


def test_custom_ce_callable_matches_head_path() -> None:
    """The trainer's fused linear + cross-entropy plugs in as ``ce``: same loss."""
    from lmforge.kernels import linear_cross_entropy_reference

    model, mtp = _setup(depth=2)
    seq = torch.randint(0, V, (2, 9))
    x, y = seq[:, :-1], seq[:, 1:]
    h = model.forward_hidden(x)
    emb, head = model.token_embeddings, model.logits_from_hidden
    want, _ = mtp_loss(mtp, h, x, y, emb, head, 0.5)

    def ce(hid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_reference(hid, model.lm_head.weight, target)

    got, _ = mtp_loss(mtp, h, x, y, emb, head, 0.5, ce=ce)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
