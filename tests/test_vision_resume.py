"""Vision objectives in the one Trainer resume bit-exactly after ``kill -9``: the VQ-VAE (its EMA
codebook step is a callback between optimizer steps, its codebook is buffers the optimizer
never sees) and CLIP pretraining (procedural data position, learned temperature).

Also a script: ``python tests/test_vision_resume.py KIND OUT_DIR STEPS [KILL_AT]`` trains KIND
(vq, clip) on a tiny model, SIGKILLing itself after step KILL_AT when given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.train import Trainer
from lmforge.vision._train import phase_train_config
from lmforge.vision.contrastive import (
    ContrastiveObjective,
    ContrastiveRunConfig,
    ImageDataConfig,
    build_dual_encoder,
    build_tokenizer,
)
from lmforge.vision.encoders import TextConfig, ViTConfig
from lmforge.vision.scenes import ProceduralScenes
from lmforge.vision.vq_train import VQObjective
from lmforge.vision.vqvae import VQVAE, CodebookUpdate, VQConfig

REPO = Path(__file__).resolve().parents[1]


def build(kind: str, out: Path, steps: int, callbacks: tuple = ()) -> Trainer:
    """A Trainer for ``kind`` (same weights and data every call), a checkpoint every step."""
    tc = phase_train_config(out, steps=steps, lr=3e-3, warmup=1, batch_size=4, device="cpu",
                            seed=0, save_every=1, plot=kind != "clip")  # fmt: skip
    torch.manual_seed(0)
    if kind == "vq":
        # restart_below high enough that dead codes restart (draws from the RNG) in these steps
        vq = VQVAE(VQConfig(channels=8, code_dim=4, codebook_size=16, decay=0.5, restart_below=0.3))
        obj: Any = VQObjective(ProceduralScenes(image_size=16), 4)
        cbs = (CodebookUpdate(vq), *callbacks)
        return Trainer(RunConfig(train=tc), model=vq, objective=obj, callbacks=cbs)
    assert kind == "clip"
    cfg = ContrastiveRunConfig(
        vision=ViTConfig(image_size=16, patch_size=8, d_model=16, n_layers=1, n_heads=2),
        text=TextConfig(context_length=40, d_model=16, n_layers=1, n_heads=2),
    )
    tok = build_tokenizer(ImageDataConfig())
    model = build_dual_encoder(cfg, tok)
    obj = ContrastiveObjective(ImageDataConfig(render_size=16, val_size=8), tok, 16, 40, 4, "clip")
    return Trainer(RunConfig(train=tc), model=model, objective=obj, callbacks=callbacks)


def _killer(at: int) -> Any:
    def cb(trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)

    return cb


def _train_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return [r["loss"] for r in records if r["event"] == "train"]


@pytest.mark.parametrize("kind,steps,kill_at", [("vq", 6, 4), ("clip", 5, 3)])
def test_kill_9_resumes_bit_exactly(tmp_path: Path, kind: str, steps: int, kill_at: int) -> None:
    straight = build(kind, tmp_path / "straight", steps)
    straight.run()
    want = {k: v.clone() for k, v in straight.model.state_dict().items()}
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(Path(__file__)), kind, str(out), str(steps)]
    first = subprocess.run([*cmd, str(kill_at)], env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert len(_train_losses(out)) == kill_at - 1  # the killed step wrote nothing
    second = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr
    resumed = build(kind, out, steps)  # loads the final checkpoint
    assert resumed.iteration == steps
    got = resumed.model.state_dict()
    for k in want:  # weights and, for the VQ-VAE, the codebook buffers
        assert torch.equal(got[k], want[k]), k
    assert _train_losses(tmp_path / "straight") == _train_losses(out)


if __name__ == "__main__":
    torch.set_num_threads(1)  # as conftest.py runs the uninterrupted run: same reductions
    kind, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    kill = (_killer(int(sys.argv[4])),) if len(sys.argv) > 4 else ()
    build(kind, out, steps, kill).run()
