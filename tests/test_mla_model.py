"""MLA, CLA and MTP as switches of the one TransformerLM: explicit (training) vs absorbed
(KV-cache decode) vs paged (engine-step Context) logits agree (fp32, 1e-5); greedy
``lmforge.generate`` equals full recompute; tiny MLA / MLA+CLA / MLA+MTP models train; the
fields survive a checkpoint; bad values are one line; accounting matches the built model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lmforge.generate import generate, greedy_generate_reference
from lmforge.model import KVCache, ModelConfig, TransformerLM, accounting
from lmforge.model.context import Context, StepOps
from lmforge.model.mla import MultiHeadLatentAttention, PagedLatentCache
from lmforge.model.moe_config import MoEConfig
from lmforge.model.mtp import mtp_loss

V = 97
MLA = dict(
    vocab_size=V, context_length=64, d_model=64, n_layers=4, n_heads=4, attention_type="mla",
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
)  # fmt: skip
VARIANTS = {
    "mla": {},
    "mla_qlora": {"q_lora_rank": 24, "attention": "reference"},
    "mla_cla2": {"kv_share_every": 2},
    "mla_cla3_mtp": {"kv_share_every": 3, "mtp_depth": 1},
}


def _model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**MLA, **kw})).eval()
    with torch.no_grad():  # non-trivial norm gains
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_explicit_equals_absorbed_kv_cache(name: str) -> None:
    """The whole model: training forward (explicit form) == prefill + token-by-token decode
    through the contiguous KVCache (absorbed form)."""
    model = _model(**VARIANTS[name])
    idx = _tokens(2, 14)
    cache = KVCache.for_model(model, 2, 32)
    if model.config.kv_share_every > 1:  # only the producing layers are cached
        assert cache.k.shape[0] == math.ceil(4 / model.config.kv_share_every)
    assert cache.k.shape[-1] == 32 + 8 and cache.v.shape[-1] == 0
    with torch.no_grad():
        want = model(idx)
        steps = [model(idx[:, :6], kv_cache=cache)]
        steps += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mla", "mla_cla2"])
def test_greedy_generate_equals_full_recompute(name: str) -> None:
    """Left-padded batch of prompts of different lengths through the KV cache == re-running
    the whole sequence for every token (no cache), per prompt."""
    model = _model(**VARIANTS[name])
    prompts = [[5, 17, 3, 44, 9, 1, 2], [60, 7], [11, 12, 13, 14]]
    got = generate(model, prompts, 10, temperature=0.0)
    for prompt, out in zip(prompts, got, strict=True):
        assert out == greedy_generate_reference(model, prompt, 10)


class _Ops(StepOps):
    """The default StepOps (attend_latent = mla_decode's torch reference here)."""


def _step(model, cache, seqs, feeds, block_size):
    """One engine-like step: ``feeds`` maps a sequence to its new tokens; ``seqs`` holds each
    sequence's tokens so far (updated) and its block table."""
    order = list(feeds)
    tokens, positions, slots, q_lens, ctx_lens, tables = [], [], [], [], [], []
    for s in order:
        past = len(seqs[s]["ids"])
        new = feeds[s]
        seqs[s]["ids"] += new
        table = seqs[s]["table"]
        for j, tok in enumerate(new):
            p = past + j
            tokens.append(tok)
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        q_lens.append(len(new))
        ctx_lens.append(past + len(new))
        tables.append(table)
    decode = all(n == 1 for n in q_lens)
    last = torch.tensor(q_lens).cumsum(0) - 1  # each sequence's last row
    ctx = Context(
        positions=torch.tensor(positions),
        slots=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        k_cache=torch.empty(0),
        v_cache=torch.empty(0),
        ops=_Ops(),
        last_rows=last,
        decode=decode,
        q_lens=None if decode else q_lens,
        ctx_lens_list=None if decode else ctx_lens,
        tables_list=None if decode else tables,
        latent_cache=cache.latent,
    )
    with torch.no_grad():
        return model(torch.tensor([tokens]), context=ctx)[0]  # (S, V)


@pytest.mark.parametrize("name", ["mla", "mla_cla2"])
def test_paged_context_steps_equal_full_forward(name: str) -> None:
    """Mixed prefill / chunked-prefill / decode steps over a PagedLatentCache (the engine's
    Context path: prefill_paged, then attend_latent) give the full forward's last-row logits."""
    model = _model(**VARIANTS[name])
    bs = 4
    k = model.config.kv_share_every
    cache = PagedLatentCache(math.ceil(4 / k), 12, bs, 40, "cpu", torch.float32)
    full = {0: _tokens(1, 13, 3)[0].tolist(), 1: _tokens(1, 9, 4)[0].tolist()}
    # block tables padded with any valid block (as the engine pads them)
    seqs = {0: {"ids": [], "table": [3, 7, 1, 9]}, 1: {"ids": [], "table": [0, 5, 11, 0]}}
    plan = [  # (feeds): prefill both, a second chunk of 0 beside a decode of 1, then decodes
        {0: full[0][:5], 1: full[1][:3]},
        {0: full[0][5:9], 1: full[1][3:4]},
        {0: full[0][9:10], 1: full[1][4:5]},
        {0: full[0][10:11], 1: full[1][5:6]},
    ]
    for feeds in plan:
        got = _step(model, cache, seqs, feeds, bs)
        for row, s in enumerate(feeds):
            ids = torch.tensor([seqs[s]["ids"]])
            with torch.no_grad():
                want = model(ids)[0, -1]
            torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mla", "mla_cla2", "mla_cla3_mtp"])
def test_tiny_models_train(name: str) -> None:
    """Loss falls; every parameter (a CLA consumer has no kv_a_proj; MTP modules through the
    MTP loss) gets a gradient."""
    cfg_kw = {**VARIANTS[name], "attention": "sdpa"}
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**MLA, **cfg_kw}))
    batch = _tokens(4, 33, 2)
    x, y = batch[:, :-1], batch[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        h = model.forward_hidden(x)  # (B, T, D)
        logits = model.logits_from_hidden(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        if model.mtp is not None:
            extra, per_depth = mtp_loss(
                model.mtp, h, x, y, model.token_embeddings, model.logits_from_hidden, 0.3
            )
            assert len(per_depth) == model.config.mtp_depth
            loss = loss + extra
        opt.zero_grad()
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_cla_consumers_have_no_latent_projection() -> None:
    model = _model(kv_share_every=2)
    attn = [layer.attn for layer in model.layers]
    assert all(isinstance(a, MultiHeadLatentAttention) for a in attn)
    assert [a.produces_kv for a in attn] == [True, False, True, False]
    assert [a.cache_index for a in attn] == [0, 0, 1, 1]
    assert not hasattr(attn[1], "kv_a_proj")


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"q_lora_rank": 24, "tie_embeddings": True},
        {"kv_share_every": 3, "mtp_depth": 2},
        {"mtp_depth": 1, "moe": MoEConfig(n_experts=4, top_k=2)},
    ],
)
def test_accounting_matches_the_model(kw) -> None:
    cfg = ModelConfig(**{**MLA, **kw})
    assert accounting.parameter_count(cfg) == TransformerLM(cfg).num_parameters()


def test_kv_cache_bytes_match_the_engine_cache() -> None:
    """accounting.kv_cache_bytes_per_token == the engine's paged cache bytes per token."""
    from lmforge.serve.model_runner import kv_bytes_per_block

    for kw in ({"attention_type": "gqa", "n_kv_heads": 2}, {}, {"kv_share_every": 3}):
        model = TransformerLM(ModelConfig(**{**MLA, **kw}))
        per_token = kv_bytes_per_block(model, 16, torch.bfloat16) // 16
        assert accounting.kv_cache_bytes_per_token(model.config, 2) == per_token
    assert accounting.kv_cache_bytes_per_token(ModelConfig(**MLA), 2) == 4 * 40 * 2


def test_attention_flops_match_flop_counter() -> None:
    """MLA's explicit-form forward FLOPs (no MTP) against torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = ModelConfig(**{**MLA, "q_lora_rank": 24, "kv_share_every": 2, "attention": "reference"})
    model = TransformerLM(cfg)
    t = 16
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(_tokens(1, t))
    assert counter.get_total_flops() == accounting.flops_per_token(cfg, t, backward=False) * t


def test_checkpoint_round_trip_carries_the_fields(tmp_path: Path) -> None:
    from lmforge.checkpoint import checkpoint_path
    from lmforge.config import RunConfig
    from lmforge.train import AdamW, load_for_inference, save_checkpoint

    cfg = ModelConfig(**{**MLA, "kv_share_every": 2, "mtp_depth": 1, "q_lora_rank": 24})
    model = _model(kv_share_every=2, mtp_depth=1, q_lora_rank=24)
    opt = AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(checkpoint_path(tmp_path, 1), model, opt, 1, config=RunConfig(model=cfg))
    loaded, _ = load_for_inference(tmp_path)
    assert loaded.config.attention_type == "mla" and loaded.config.kv_share_every == 2
    assert loaded.config.mtp_depth == 1 and loaded.config.q_lora_rank == 24
    idx = _tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)
    torch.testing.assert_close(
        loaded.mtp.layers[0].proj.weight, model.mtp.layers[0].proj.weight, atol=0, rtol=0
    )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("model.mtp_depth=-1", "mtp_depth must be an integer >= 0"),
        ("model.qk_rope_head_dim=7", "qk_rope_head_dim must be even"),
        ("model.kv_lora_rank=100", "kv_lora_rank .100. must not exceed d_model"),
        ("model.kv_share_every=0", "kv_share_every must be an integer >= 1"),
        ("model.qk_norm=true", "mla does not support qk_norm"),
        ("model.attention_type=mqa", "model.attention_type.: expected .gqa. | .mla."),
    ],
)
def test_config_errors_are_one_line(override: str, match: str) -> None:
    from lmforge.config import load_run_config
    from lmforge.utils.errors import LmforgeError

    base = [f"model.{k}={v}" for k, v in MLA.items()]
    with pytest.raises(LmforgeError, match=match) as err:
        load_run_config(None, [*base, override])
    assert "\n" not in str(err.value)


def test_cla_needs_full_attention_layers() -> None:
    """CLA is for MLA and GQA alike (tests/test_gqa_cla.py), full-attention layers only."""
    ModelConfig(d_model=64, n_heads=4, kv_share_every=2)  # GQA + CLA: accepted
    for kw in ({"layers": "GA"}, {**MLA, "layers": "AS"}):
        with pytest.raises(ValueError, match="needs full-attention layers only") as err:
            ModelConfig(**{"d_model": 64, "n_heads": 4, "n_layers": 4, **kw, "kv_share_every": 2})
        assert "\n" not in str(err.value)


def test_the_trainer_trains_an_mla_cla_model(tmp_path: Path) -> None:
    """The one Trainer (``lmforge.train.train``), unchanged, on an MLA + CLA model: the loss
    of a learnable stream falls and the checkpoint reloads with the fields."""
    import numpy as np

    from lmforge.config import load_run_config
    from lmforge.train import load_for_inference, train
    from lmforge.train.data import write_shard
    from lmforge.train.trainer import read_metrics

    rng = np.random.default_rng(0)
    base = np.tile(np.arange(50), 300)
    toks = np.where(rng.random(base.size) < 0.1, rng.integers(0, V, base.size), base)
    tr = write_shard(tmp_path / "train.bin", toks[:12000], V, num_bytes=36000)
    va = write_shard(tmp_path / "val.bin", toks[12000:], V, num_bytes=9000)
    model = {**MLA, "kv_share_every": 2, "n_layers": 2}
    overrides = [f"model.{k}={v}" for k, v in model.items()] + [
        f'data.train=["{tr}"]', f'data.val=["{va}"]', f"train.out_dir={tmp_path / 'run'}",
        "train.device=cpu", "train.precision=fp32", "train.batch_size=4",
        "train.context_length=32", "train.lr=3e-3", "train.warmup_steps=5",
        "train.max_steps=40", "train.log_every=1", "train.eval_every=40", "train.eval_batches=2",
        "train.save_every=40", "train.progress=false",
    ]  # fmt: skip
    train(load_run_config(None, overrides))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
              if r.get("event") == "train"]  # fmt: skip
    assert len(losses) == 40 and losses[-1] < 0.6 * losses[0], losses
    loaded, _ = load_for_inference(tmp_path / "run")
    assert loaded.config.attention_type == "mla" and loaded.config.kv_share_every == 2


def test_cla_under_activation_checkpointing_gives_the_same_gradients() -> None:
    """The trainer's activation checkpointing wraps each block's forward: a CLA block's
    (x, latents) pair goes through it, gradients unchanged."""
    from lmforge.train.wrap import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = TransformerLM(ModelConfig(**{**MLA, "kv_share_every": 2}))
    torch.manual_seed(0)
    wrapped = apply_activation_checkpointing(
        TransformerLM(ModelConfig(**{**MLA, "kv_share_every": 2}))
    )
    x = _tokens(2, 10)
    for m in (plain, wrapped):
        m(x).logsumexp(-1).mean().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)
