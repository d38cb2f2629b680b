"""``lmforge vision``: registered here so torch is imported only when a subcommand runs."""

from __future__ import annotations

import argparse

PRETRAIN_EXAMPLES = """examples:
  lmforge vision pretrain --config configs/vision/clip-tiny.toml           # CLIP, CPU, minutes
  lmforge vision pretrain --config configs/vision/clip-tiny.toml --train.loss=siglip \\
      --train.out=runs/vision/siglip-tiny                                   # SigLIP
  lmforge vision pretrain --config configs/vision/clip-tiny.toml --data.source=folder \\
      --data.path=my_images/captions.jsonl --data.val_path=my_images/val.jsonl
  lmforge vision pretrain --config configs/vision/clip-tiny.toml --data.source=tar \\
      --data.path='shards/train-*.tar' --data.val_path='shards/val-*.tar'

Folder data: one JSON object per line, {"image": "relative/path.png", "caption": "..."}.
Tar shards: WebDataset layout (KEY.png + KEY.txt, or KEY.json with a "caption").
Trains in lmforge's Trainer (AdamW, warm-up + cosine, clipping). Writes config.toml, vocab.json,
results.json (recall@1/@5 image→text and text→image) and train/ (metrics.jsonl with the periodic
evaluations, checkpoints/step_*) to --train.out; a rerun resumes from the latest checkpoint.
"""

VLM_EXAMPLES = """examples:
  lmforge vision vlm --config configs/vision/vlm-tiny.toml --encoder runs/vision/clip-tiny
  lmforge vision vlm --config configs/vision/vlm-tiny.toml --encoder runs/vision/clip-tiny \\
      --vlm.stage2_steps=0                                                 # stage 1 only
  lmforge vision vlm --config configs/vision/vlm-tiny.toml --encoder runs/vision/clip-tiny \\
      --lm.mrope_sections=[4,6,6] --vlm.out=runs/vision/vlm-mrope        # MRoPE (Qwen2-VL)

Trains, on procedural scenes: a text-only LM given the caption (upper bound) and given only the
question (lower bound), then the VLM's projector (stage 1: captioning, ViT and LM frozen) and
projector + LM (stage 2: question answering). Prints held-out answer accuracy per question
kind (count, color, position, digit) for each and writes results.json to --vlm.out. Each phase
is an objective of lmforge's Trainer in its own folder (text/, stage1/, stage2/: metrics.jsonl,
loss_curve.png, checkpoints); a rerun resumes where it stopped. --lm.mrope_sections=[t,h,w]
(summing to the LM's head_dim / 2) gives image tokens Qwen2-VL's 2D grid positions (MRoPE);
the run folder then serves with them (lmforge serve --checkpoint).
"""

VQ_EXAMPLES = """examples:
  lmforge vision vqvae --config configs/vision/vq-tiny.toml
  lmforge vision vqvae --config configs/vision/vq-tiny.toml --vq_train.steps=2000 --lm_train.steps=3000

Trains a VQ-VAE on procedural scenes (reconstruction MSE, codebook perplexity, PNG grid of
reconstructions), then an LM with QK-norm and z-loss on interleaved caption + image tokens that
captions images and generates them (PNG grid of samples, caption accuracy on its own samples).
Both phases run in lmforge's Trainer (folders vq/ and lm/ under --run.out; the codebook's EMA
step is a callback after each optimizer step); a rerun resumes where it stopped.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``vision`` with its ``pretrain``, ``vlm`` and ``vqvae`` subcommands."""
    from lmforge.cli import add_config_arguments

    p = sub.add_parser(
        "vision",
        help="multimodal: CLIP/SigLIP pretraining, a LLaVA-style VLM, VQ-VAE image tokens",
        description="Vision-language models on procedural scenes or your own image-caption data.",
    )
    cmds = p.add_subparsers(dest="vision_command", metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter
    pre = cmds.add_parser(
        "pretrain",
        help="contrastive image-text pretraining (CLIP or SigLIP) with retrieval evaluation",
        description=(
            "Train a ViT and a text encoder contrastively and report zero-shot retrieval "
            "recall@1/@5 on held-out pairs."
        ),
        epilog=PRETRAIN_EXAMPLES,
        formatter_class=fmt,
    )
    add_config_arguments(pre, "vision TOML (see configs/vision/); keys not given take defaults")
    pre.set_defaults(func=_pretrain)
    vlm = cmds.add_parser(
        "vlm",
        help="LLaVA-style VLM: projector (stage 1), projector + LM (stage 2), QA accuracy",
        description="Train and evaluate a VLM on a pretrained vision encoder.",
        epilog=VLM_EXAMPLES,
        formatter_class=fmt,
    )
    add_config_arguments(vlm, "VLM TOML (see configs/vision/vlm-tiny.toml)")
    vlm.add_argument("--encoder", metavar="DIR", required=True, help="a `vision pretrain` run")
    vlm.set_defaults(func=_vlm)
    vq = cmds.add_parser(
        "vqvae",
        help="VQ-VAE image tokens and an interleaved text+image-token LM",
        description="Train a VQ-VAE, then an LM that captions and generates images as tokens.",
        epilog=VQ_EXAMPLES,
        formatter_class=fmt,
    )
    add_config_arguments(vq, "VQ TOML (see configs/vision/vq-tiny.toml)")
    vq.set_defaults(func=_vqvae)
    p.set_defaults(func=lambda args: p.error("choose a command: pretrain, vlm, vqvae"))


def _log(record: dict) -> None:
    """Print evaluations, the run header and every 25th step as one JSON line each."""
    import json

    evaluation = any("@" in k or "acc" in k for k in record) or "params" in record
    if evaluation or record.get("step", 0) % 25 == 0:
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}
        print(json.dumps(rounded), flush=True)


def _pretrain(args: argparse.Namespace) -> int:
    from lmforge.utils.config import load_config
    from lmforge.vision.contrastive import ContrastiveRunConfig, pretrain

    cfg = load_config(ContrastiveRunConfig, args.config, args.overrides)
    pretrain(cfg, log=_log)
    return 0


def _vlm(args: argparse.Namespace) -> int:
    from lmforge.utils.config import load_config
    from lmforge.vision.vlm_train import VLMRunConfig, run_vlm

    cfg = load_config(VLMRunConfig, args.config, args.overrides)
    run_vlm(cfg, args.encoder, log=_log)
    return 0


def _vqvae(args: argparse.Namespace) -> int:
    from lmforge.utils.config import load_config
    from lmforge.vision.vq_train import VQRunConfig, run_vq

    cfg = load_config(VQRunConfig, args.config, args.overrides)
    run_vq(cfg, log=_log)
    return 0
