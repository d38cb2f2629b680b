"""Checkpoints: exact round trip, tied weights once, atomic saves, keep-last-K, inference loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmforge.checkpoint import checkpoint_path, list_checkpoints, prune_checkpoints
from lmforge.checkpoint import io as ckpt_mod
from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM, load_preset
from lmforge.train import (
    AdamW,
    latest_checkpoint,
    load_checkpoint,
    load_for_inference,
    save_checkpoint,
)
from lmforge.utils.errors import LmforgeError


def _trained(seed: int = 0, cfg: ModelConfig | None = None) -> tuple[TransformerLM, AdamW]:
    cfg = cfg or load_preset("tiny")
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(3):
        idx = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(i))
        model(idx).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_roundtrip_model_and_optimizer_exact(tmp_path: Path) -> None:
    model, opt = _trained(0)
    path = save_checkpoint(tmp_path / "ck", model, opt, iteration=3)
    assert json.loads((path / "meta.json").read_text())["format"] == "lmforge-checkpoint-v1"
    model2, opt2 = _trained(1)  # different weights and state, same shapes
    assert load_checkpoint(path, model2, opt2) == 3
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for pid in s1["state"]:
        for k, v in s1["state"][pid].items():
            assert torch.equal(v, s2["state"][pid][k]), (pid, k)
    # the resumed optimizer continues identically
    for m, o in ((model, opt), (model2, opt2)):
        m(torch.arange(8).view(1, 8)).float().mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_tied_weights_stored_once(tmp_path: Path) -> None:
    cfg = ModelConfig(
        vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2, tie_embeddings=True
    )
    model, opt = _trained(0, cfg)
    path = save_checkpoint(tmp_path / "ck", model, opt, iteration=1)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        tied = json.loads(f.metadata()["tied"])
    assert "lm_head.weight" not in keys and "token_embeddings.weight" in keys
    assert tied == {"lm_head.weight": "token_embeddings.weight"}
    torch.manual_seed(5)
    other = TransformerLM(cfg)
    load_checkpoint(path, other)
    assert other.lm_head.weight is other.token_embeddings.weight
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_crash_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained(0)
    good = save_checkpoint(checkpoint_path(tmp_path, 10), model, opt, iteration=10)
    before = (good / "model.safetensors").read_bytes()

    real_save = ckpt_mod.save_file

    def crash_after_model(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        real_save(tensors, filename, metadata=metadata)
        if filename.endswith("optimizer.safetensors"):
            raise KeyboardInterrupt("simulated crash mid-save")

    monkeypatch.setattr(ckpt_mod, "save_file", crash_after_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_path(tmp_path, 20), model, opt, iteration=20)
    # a crash while overwriting the same step must not destroy it either
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(good, model, opt, iteration=10)
    assert not checkpoint_path(tmp_path, 20).exists()
    assert latest_checkpoint(tmp_path) == good
    assert (good / "model.safetensors").read_bytes() == before
    fresh, fresh_opt = _trained(3)
    assert load_checkpoint(good, fresh, fresh_opt) == 10


def test_leftover_temp_folder_is_ignored_and_pruned(tmp_path: Path) -> None:
    model, opt = _trained(0)
    save_checkpoint(checkpoint_path(tmp_path, 1), model, opt, iteration=1)
    stale = tmp_path / "checkpoints" / ".tmp-step_0000002-999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    prune_checkpoints(tmp_path, keep_last=3)
    assert not stale.exists()


def test_keep_last_k(tmp_path: Path) -> None:
    model, opt = _trained(0)
    for it in (5, 10, 15, 20):
        save_checkpoint(checkpoint_path(tmp_path, it), model, opt, iteration=it)
        prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000015", "step_0000020"]


def test_load_for_inference(tmp_path: Path) -> None:
    cfg = load_preset("tiny")
    model, opt = _trained(0, cfg)
    run = tmp_path / "run"
    save_checkpoint(checkpoint_path(run, 7), model, opt, 7, config=RunConfig(model=cfg))
    loaded, tok = load_for_inference(run)  # a run folder → its latest checkpoint
    assert tok is None and not loaded.training
    idx = torch.arange(10).view(1, 10)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)
    # config/weights mismatch → one clear line
    bad = checkpoint_path(run, 7) / "config.toml"
    bad.write_text(bad.read_text().replace("d_model = 64", "d_model = 32"))
    with pytest.raises(LmforgeError, match="do not match"):
        load_for_inference(checkpoint_path(run, 7))
    (checkpoint_path(run, 7) / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LmforgeError, match="cannot read model weights"):
        load_for_inference(checkpoint_path(run, 7))
    with pytest.raises(LmforgeError, match="neither a checkpoint"):
        load_for_inference(tmp_path / "nowhere")


def test_tokenizer_copied_and_loaded(tmp_path: Path) -> None:
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(tmp_path / "tok")
    model, opt = _trained(0)
    path = save_checkpoint(
        tmp_path / "ck",
        model,
        opt,
        1,
        config=RunConfig(model=load_preset("tiny")),
        tokenizer_dir=tmp_path / "tok",
    )
    assert (path / "tokenizer").is_dir()
    _, loaded = load_for_inference(path)
    assert loaded is not None and loaded.vocab_size == tok.vocab_size
    assert loaded.decode(loaded.encode("héllo")) == "héllo"
