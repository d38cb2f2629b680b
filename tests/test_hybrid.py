"""Hybrid layer patterns (``model.layers``): full, sliding-window and linear-attention blocks in the
one forward.

The pattern's errors are one line at config load; sliding-window attention equals a naive masked
softmax on every backend; a hybrid's forward equals a reference composed from its modules (token
loops for the linear mixers, a naive windowed softmax for attention); a tiny hybrid trains;
checkpoints carry the pattern; the KV-cache and engine paths refuse hybrids in one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import KVCache, ModelConfig, TransformerLM
from lmforge.model.attention import CausalSelfAttention, sliding_window_mask
from lmforge.utils.config import from_dict
from lmforge.utils.errors import LmforgeError


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=61, context_length=64, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2,
        layers="GMLWA", window=5, ssm_state=16, ssm_head_dim=16, linear_heads=2,
        linear_head_dim=16, attention="reference",
    )  # fmt: skip
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": "GGXA"}, "unknown layer type 'X'"),
        ({"layers": ""}, "non-empty pattern"),
        ({"window": 0}, "window must be positive"),
        ({"layers": "GGMA", "ssm_head_dim": 24}, "must divide ssm_expand·d_model"),
        ({"linear_head_dim": -1}, "linear_head_dim must be positive"),
        ({"conv_size": 1}, "conv_size must be at least 2"),
        # grouped value heads (Qwen3-Next's 16 q/k : 32 value heads)
        ({"linear_heads": 2, "linear_v_heads": 3}, r"linear_v_heads \(3\) must be a multiple"),
        ({"linear_v_heads": 0}, "linear_v_heads must be positive"),
        ({"linear_v_head_dim": -8}, "linear_v_head_dim must be positive"),
        ({"layers": "GLA", "linear_v_heads": 8}, "for G layers only"),
        ({"layers": "GLA", "linear_v_head_dim": 8}, "for G layers only"),
    ],
)
def test_bad_pattern_is_one_line_at_config_load(change: dict, message: str) -> None:
    data = {"d_model": 64, "n_heads": 4, "n_layers": 4, "layers": "GGGA"} | change
    with pytest.raises(LmforgeError, match=message) as err:
        from_dict(ModelConfig, data, prefix="model")
    assert "\n" not in str(err.value) and "model" in str(err.value)


def test_pattern_repeats_to_n_layers() -> None:
    cfg = ModelConfig(d_model=64, n_heads=4, n_layers=6, layers="GGGA")
    assert cfg.layer_types == ("G", "G", "G", "A", "G", "G")
    assert not cfg.full_attention_only and ModelConfig().full_attention_only
    kinds = [type(b.attn).__name__ for b in TransformerLM(_cfg(n_layers=7)).layers]
    assert kinds == ["GatedDeltaNet", "Mamba2Mixer", "LinearAttention"] + [
        "CausalSelfAttention"
    ] * 2 + ["GatedDeltaNet", "Mamba2Mixer"]


def _naive_attention(q, k, v, window: int | None) -> torch.Tensor:
    """q (B, H, T, E), k, v (B, K, T, E): a softmax over each query's allowed keys, one by one."""
    _, H, T, E = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, H, T, E)
    out = torch.zeros_like(q)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        s = q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-1, -2) / math.sqrt(E)
        out[:, :, i] = (s.softmax(-1) @ v[:, :, lo : i + 1])[:, :, 0]
    return out


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flash"])
@pytest.mark.parametrize("window", [1, 4, 40])
def test_sliding_window_attention_equals_naive_masked_softmax(backend: str, window: int) -> None:
    cfg = _cfg(attention=backend, layers="W", window=window)
    attn = CausalSelfAttention(cfg, 0, window)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 23, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 23, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(attn._causal(q, k, v), _naive_attention(q, k, v, window))
    mask = sliding_window_mask(5, 2)
    assert mask.tolist()[4] == [False, False, False, True, True]


def _reference_forward(model: TransformerLM, idx: torch.Tensor) -> torch.Tensor:
    """The hybrid composed from its modules: linear mixers as token-by-token decoding loops
    (``step`` from the zero state), attention as the naive windowed softmax."""
    cfg = model.config
    x = model.token_embeddings(idx)  # (B, T, D)
    B, T, _ = x.shape
    for block, kind in zip(model.layers, cfg.layer_types):
        h = block.ln1(x)
        if kind in "AW":
            a = block.attn
            q = a.q_proj(h).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)  # (B, H, T, E)
            k = a.k_proj(h).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, K, T, E)
            v = a.v_proj(h).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
            pos = torch.arange(T)
            q, k = a.rope(q, pos), a.rope(k, pos)
            o = _naive_attention(q, k, v, cfg.window if kind == "W" else None)
            y = a.output_proj(o.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)
        else:
            state, ys = block.attn.init_state(B), []
            for t in range(T):
                y_t, state = block.attn.step(h[:, t], state)
                ys.append(y_t)
            y = torch.stack(ys, 1)  # (B, T, D)
        x = x + y
        x = x + block.ffn(block.ln2(x))
    return model.logits_from_hidden(model.ln_final(x))


@pytest.mark.parametrize(
    "kw",
    [{}, dict(layers="GMWGA", linear_v_heads=4, linear_v_head_dim=8)],  # grouped value heads
    ids=["plain", "grouped_v_heads"],
)
def test_hybrid_forward_equals_reference_composed_from_modules(kw: dict) -> None:
    torch.manual_seed(0)
    model = TransformerLM(_cfg(n_layers=6, **kw), dtype=torch.float64)
    idx = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # float32-level tolerance: the mixers keep their gates and recurrent states in float32.
        torch.testing.assert_close(model(idx), _reference_forward(model, idx), rtol=1e-4, atol=1e-5)


def test_tiny_hybrid_trains() -> None:
    torch.manual_seed(0)
    model = TransformerLM(_cfg(layers="GMLW", n_layers=4, attention="sdpa"))
    gen = torch.Generator().manual_seed(2)
    batch = torch.randint(0, 61, (4, 33), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(batch[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_checkpoint_round_trip_keeps_the_pattern(tmp_path) -> None:
    from lmforge.checkpoint.io import load_for_inference, save_checkpoint
    from lmforge.config import RunConfig

    torch.manual_seed(0)
    cfg = _cfg(layers="GMWA", n_layers=4, window=7, linear_decay=False, linear_v_heads=4)
    model = TransformerLM(cfg)
    save_checkpoint(tmp_path / "ck", model, None, 3, config=RunConfig(model=cfg))
    loaded, _ = load_for_inference(tmp_path / "ck")
    assert loaded.config.layers == "GMWA" and loaded.config.window == 7
    assert loaded.config.linear_dims == (2, 16, 4, 16)
    assert loaded.config.linear_decay is False and loaded.config.ssm_state == 16
    idx = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model.eval()(idx))


def test_kv_cache_decodes_sparse_layers() -> None:
    # Every letter decodes with a cache; S (top-2 of 9 keys) here in brief, in full in
    # tests/test_dsa_decode.py (and served: tests/test_engine_switches.py).
    torch.manual_seed(0)
    model = TransformerLM(_cfg(layers="SA", n_layers=2, dsa_topk=2, dsa_index_dim=8)).eval()
    idx = torch.randint(0, 61, (1, 9))
    cache = KVCache.for_model(model, 1, 9)
    with torch.no_grad():
        steps = [model(idx[:, :4], kv_cache=cache)]
        steps += [model(idx[:, i : i + 1], kv_cache=cache) for i in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), model(idx), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [dict(layers="GMLWA"), dict(layers="GMWGA", linear_v_heads=4, linear_v_head_dim=8)],
    ids=["plain", "grouped_v_heads"],
)
def test_gpu_hybrid_on_triton_kernels_matches_torch_path_and_trains(kw: dict) -> None:
    # The linear mixers' auto backend is the Triton kernels on CUDA; the torch chunked path is
    # their CPU path. float32 weights and inputs: the kernels' 3×TF32 dots are fp32-accurate.
    torch.manual_seed(0)
    model = TransformerLM(_cfg(attention="sdpa", **kw), device="cuda")
    idx = torch.randint(0, 61, (2, 100), device="cuda")
    with torch.no_grad():
        fast = model(idx)
        for block in model.layers:
            if block.recurrent:
                block.attn.backend = "torch"
        slow = model(idx)
        for block in model.layers:
            if block.recurrent:
                block.attn.backend = "auto"
    torch.testing.assert_close(fast, slow, rtol=1e-3, atol=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
