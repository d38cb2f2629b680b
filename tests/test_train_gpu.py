"""The trainer on one CUDA GPU: bf16 autocast, torch.compile, the auto (fused) loss (tier ``gpu``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import load_preset
from lmforge.train import DataConfig, TrainConfig, Trainer, load_for_inference
from lmforge.train.data import write_shard
from lmforge.train.trainer import read_metrics

pytestmark = pytest.mark.gpu


def _cfg(tmp: Path, **train: object) -> RunConfig:
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(50), 2000)
    toks = np.where(rng.random(base.size) < 0.1, rng.integers(0, 512, base.size), base)
    tr = write_shard(tmp / "train.bin", toks[:90000], 512, num_bytes=270000)
    va = write_shard(tmp / "val.bin", toks[90000:], 512, num_bytes=30000)
    t = dict(
        out_dir=str(tmp / "run"),
        device="cuda",
        precision="bf16",
        batch_size=8,
        context_length=64,
        max_steps=60,
        lr=3e-3,
        warmup_steps=5,
        log_every=1,
        eval_every=30,
        eval_batches=4,
        save_every=30,
        progress=False,
    )
    t.update(train)
    return RunConfig(
        model=load_preset("tiny"),
        train=TrainConfig(**t),
        data=DataConfig(train=(str(tr),), val=(str(va),)),
    )


@pytest.mark.parametrize("compile_", [False, True])
def test_trains_on_gpu_bf16(tmp_path: Path, compile_: bool) -> None:
    result = Trainer(_cfg(tmp_path, compile=compile_, loss="auto")).run()
    curve = [
        r["loss"]
        for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
        if r.get("event") == "train"
    ]
    assert len(curve) == 60 and np.mean(curve[-5:]) < np.mean(curve[:5]) - 1.0
    assert np.isfinite(result["val_loss"])
    model, _ = load_for_inference(tmp_path / "run", device="cuda")
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights were saved


def test_fused_and_reference_losses_agree_on_gpu(tmp_path: Path) -> None:
    pytest.importorskip("lmforge.kernels")
    ref = Trainer(_cfg(tmp_path, loss="reference"))
    fused = Trainer(_cfg(tmp_path, loss="fused"))
    x, y = ref.sampler.next_batch(8, "cuda")
    a, b = ref.loss_fn(ref.model, x, y), fused.loss_fn(fused.model, x, y)
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)  # bf16 logits
