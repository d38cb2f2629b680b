"""`lmforge vision pretrain`: config, objective, training and resuming in the Trainer, retrieval."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.utils.config import ConfigError, load_config
from lmforge.vision.contrastive import (
    ContrastiveObjective,
    ContrastiveRunConfig,
    ImageDataConfig,
    build_tokenizer,
    pretrain,
)

TINY = [
    "vision.image_size=24",
    "vision.d_model=32",
    "vision.n_layers=1",
    "vision.n_heads=2",
    "text.d_model=32",
    "text.n_layers=1",
    "text.n_heads=2",
    "text.context_length=40",
    "joint.embed_dim=16",
    "data.val_size=32",
    "train.batch_size=16",
    "train.warmup=2",
    "train.eval_every=0",
    "train.threads=1",
]


def _cfg(tmp_path, *extra: str) -> ContrastiveRunConfig:
    return load_config(
        ContrastiveRunConfig,
        "configs/vision/clip-tiny.toml",
        [*TINY, f"train.out={tmp_path / 'run'}", *extra],
    )


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_pretrain_learns_and_resumes(tmp_path, loss: str) -> None:
    cfg = _cfg(
        tmp_path, "train.steps=40", "train.save_every=20", f"train.loss={loss}", "train.lr=3e-3"
    )
    logs: list[dict] = []
    result = pretrain(cfg, log=logs.append)
    losses = [r["loss"] for r in logs if "loss" in r and isinstance(r["loss"], float)]
    assert losses[-1] < losses[0]
    assert set(result) == {"i2t@1", "t2i@1", "i2t@5", "t2i@5", "n"} and result["n"] == 32
    run = tmp_path / "run"
    assert [p.name for p in sorted((run / "train" / "checkpoints").iterdir())] == [
        "step_0000020",
        "step_0000040",
    ]
    records = [json.loads(line) for line in (run / "train" / "metrics.jsonl").open()]
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[-1]["step"] == 40 and evals[-1]["i2t@1"] == result["i2t@1"]
    assert json.loads((run / "results.json").read_text()) == result
    # rerunning with more steps resumes at 40 (only 10 new train records)
    more = _cfg(
        tmp_path, "train.steps=50", "train.save_every=20", f"train.loss={loss}", "train.lr=3e-3"
    )
    logs2: list[dict] = []
    pretrain(more, log=logs2.append)
    assert [r["step"] for r in logs2 if "grad_norm" in r] == list(range(41, 51))


def test_objective_shards_ranks_and_restores_position() -> None:
    tok = build_tokenizer(ImageDataConfig())
    full = ContrastiveObjective(ImageDataConfig(), tok, 24, 40, 4)
    r0 = ContrastiveObjective(ImageDataConfig(), tok, 24, 40, 2, rank=0, world_size=2)
    r1 = ContrastiveObjective(ImageDataConfig(), tok, 24, 40, 2, rank=1, world_size=2)
    images, tokens = full.next_batch()
    assert images.shape == (4, 3, 24, 24) and tokens.shape == (4, 40)
    torch.testing.assert_close(r0.next_batch()[1], tokens[0::2])
    torch.testing.assert_close(r1.next_batch()[1], tokens[1::2])
    again = ContrastiveObjective(ImageDataConfig(), tok, 24, 40, 4)
    again.load_state_dict({"batches": 1})
    full_second = full.next_batch()[1]
    torch.testing.assert_close(again.next_batch()[1], full_second)


def test_config_errors_are_one_line(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'"):
        _cfg(tmp_path, "train.lrr=1")
    with pytest.raises(ConfigError, match=r"train\.lr must be positive, got -1"):
        _cfg(tmp_path, "train.lr=-1")
    with pytest.raises(ConfigError, match=r"train\.warmup must be 0 or more"):
        _cfg(tmp_path, "train.warmup=-3")
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        _cfg(tmp_path, "vision.patch_size=5")
    status = main(
        [
            "vision",
            "pretrain",
            "--config",
            "configs/vision/clip-tiny.toml",
            "--data.source=folder",
            f"--data.path={tmp_path / 'none.jsonl'}",
            f"--train.out={tmp_path / 'r'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0 and "caption file not found" in err


def test_help_lists_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["vision", "pretrain", "--help"])
    assert (
        "lmforge vision pretrain --config configs/vision/clip-tiny.toml" in capsys.readouterr().out
    )


def test_worker_processes_draw_the_same_batches() -> None:
    tok = build_tokenizer(ImageDataConfig())
    plain = ContrastiveObjective(ImageDataConfig(), tok, 24, 40, 6, rank=1, world_size=2)
    pooled = ContrastiveObjective(ImageDataConfig(workers=2), tok, 24, 40, 6, rank=1, world_size=2)
    for _ in range(2):
        a, b = plain.next_batch(), pooled.next_batch()
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])
    pooled._pool.shutdown()
