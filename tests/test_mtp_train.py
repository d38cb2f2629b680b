"""MTP as a training signal of the one LM objective: ``model_loss`` / ``fused_model_loss`` add
``mtp_weight · mean_k CE_k`` in training mode (validation stays the main head's), and the one
Trainer trains the MTP modules (train.loss=fused runs on the CPU too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.kernels import fused_linear_cross_entropy
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.mtp import mtp_loss
from lmforge.train.loss import cross_entropy, fused_model_loss, model_loss

V = 97
CFG = dict(
    vocab_size=V, context_length=64, d_model=64, n_layers=2, n_heads=4, attention_type="mla",
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, mtp_depth=2,
    mtp_weight=0.5,
)  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(3))
    return seq[:, :-1], seq[:, 1:]


@pytest.mark.parametrize("fused", [False, True])
def test_lm_loss_adds_the_mtp_loss_in_training_only(fused: bool) -> None:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**CFG))
    x, y = _batch()
    with torch.no_grad():
        h = model.forward_hidden(x)
        main = cross_entropy(model.logits_from_hidden(h), y)
        extra, per_depth = mtp_loss(
            model.mtp, h, x, y, model.token_embeddings, model.logits_from_hidden, 0.5
        )
    assert len(per_depth) == 2

    def loss() -> torch.Tensor:
        if fused:
            return fused_model_loss(model, fused_linear_cross_entropy, x, y, 0.0)
        return model_loss(model, x, y, 0.0)

    with torch.no_grad():
        torch.testing.assert_close(loss(), main + extra, atol=1e-5, rtol=1e-5)
        model.eval()
        torch.testing.assert_close(loss(), main, atol=1e-5, rtol=1e-5)
    model.train()
    loss().backward()
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_the_trainer_trains_the_mtp_modules(tmp_path: Path) -> None:
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
    overrides = [f"model.{k}={v}" for k, v in CFG.items()] + [
        f'data.train=["{tr}"]', f'data.val=["{va}"]', f"train.out_dir={tmp_path / 'run'}",
        "train.device=cpu", "train.precision=fp32", "train.batch_size=4", "train.loss=fused",
        "train.context_length=32", "train.lr=3e-3", "train.warmup_steps=5",
        "train.max_steps=30", "train.log_every=1", "train.eval_every=30", "train.eval_batches=2",
        "train.save_every=30", "train.progress=false",
    ]  # fmt: skip
    torch.manual_seed(0)
    init = TransformerLM(ModelConfig(**CFG)).mtp.state_dict()
    train(load_run_config(None, overrides))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
              if r.get("event") == "train"]  # fmt: skip
    assert losses[-1] < 0.6 * losses[0], losses
    model, _ = load_for_inference(tmp_path / "run")
    x = torch.tensor([list(range(10, 40))])
    with torch.no_grad():  # depth 1 learned the stream: t+2 after ..., t, t+1 is t+2
        h = model.forward_hidden(x[:, :-1])
        logits = model.mtp(h, x[:, :-1], model.token_embeddings, model.logits_from_hidden)
    assert (logits[0][0, :-1].argmax(-1) == x[0, 2:-1]).float().mean() > 0.8
    moved = [k for k, v in model.mtp.state_dict().items() if not torch.equal(v, init[k])]
    assert moved
    # self-speculative decoding with the trained modules: drafts accepted, output unchanged
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.speculative import speculative_from_flag

    params = SamplingParams(temperature=0, max_tokens=16)
    prompt = list(range(5, 25))
    plain = Engine(model).generate([prompt], params)[0].outputs[0].token_ids
    spec = speculative_from_flag(model, "mtp", 2)
    got = Engine(model, speculative=spec).generate([prompt], params)[0].outputs[0].token_ids
    assert got == plain and spec.stats.acceptance > 0.5, spec.stats


def test_the_reference_loss_path_trains_the_mtp_modules_too(tmp_path: Path) -> None:
    """The CPU default (``train.loss=reference``, not compiled) once called ``model(x)`` and
    left the MTP modules without a gradient: their weights must move there as well."""
    import numpy as np

    from lmforge.config import load_run_config
    from lmforge.train import Trainer
    from lmforge.train.data import write_shard

    toks = np.tile(np.arange(50), 40)
    tr = write_shard(tmp_path / "train.bin", toks, V, num_bytes=6000)
    overrides = [f"model.{k}={v}" for k, v in CFG.items()] + [
        f'data.train=["{tr}"]', f"train.out_dir={tmp_path / 'run'}", "train.device=cpu",
        "train.precision=fp32", "train.batch_size=2", "train.loss=reference",
        "train.compile=false", "train.context_length=16", "train.max_steps=2",
        "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.plot=false",
    ]  # fmt: skip
    trainer = Trainer(load_run_config(None, overrides))
    assert trainer.fused is None
    before = {k: v.clone() for k, v in trainer.model.mtp.state_dict().items()}
    trainer.run()
    after = trainer.model.mtp.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
