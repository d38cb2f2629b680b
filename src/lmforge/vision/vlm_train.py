"""``lmforge vision vlm``: the LLaVA recipe on procedural scenes, with its two text-only bounds.

1. **Text LM** (an lmforge ``TransformerLM``) trained on ``caption question → answer``: given
   the caption at test time it is the *upper bound* (the caption states every answer). The same
   recipe without the caption (``question → answer``) is the *lower bound* (answer priors only).
2. **Stage 1**: ViT (from ``lmforge vision pretrain``) and the text LM frozen; the projector is
   trained on captioning (``<image> → caption``), aligning image tokens with the LM's words.
3. **Stage 2**: projector + LM trained on ``<image> question → answer`` (ViT frozen).

Held-out accuracy per question kind (count, color, position, digit) after each, on ``val``
scenes. Exercised by ``pytest tests/test_vision_vlm.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from lmforge.model.config import ModelConfig
from lmforge.utils.config import load_config, save_config
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text
from lmforge.vision._train import check_phase
from lmforge.vision.scenes import ProceduralScenes


@dataclasses.dataclass(frozen=True)
class VLMConfig:
    """The VLM phases (``[vlm]``)."""

    batch_size: int = 32
    "sequences per step"
    text_steps: int = 600
    "steps of the text LM (caption + question → answer; also the bounds)"
    stage1_steps: int = 300
    "projector-only steps on captioning"
    stage2_steps: int = 600
    "projector + LM steps on question answering"
    lr: float = 2e-3
    "peak learning rate of the text LM and stage 1 (AdamW, warm-up then cosine to lr/10)"
    stage2_lr: float = 1e-3
    "peak learning rate of stage 2"
    warmup: int = 30
    "warm-up steps of every phase"
    eval_scenes: int = 200
    "held-out scenes whose questions are scored (every question of each)"
    max_objects: int = 3
    "objects per scene: 1..max_objects"
    seed: int = 0
    "seed of the weights and the scenes"
    device: str = "cpu"
    "cpu, cuda, auto"
    threads: int = 0
    "CPU threads for torch (0 = torch's default)"
    out: str = "runs/vision/vlm-tiny"
    "run folder: config.toml, vision.toml, vocab.json, results.json, a Trainer folder per phase"

    def __post_init__(self) -> None:
        check_phase("vlm", batch_size=self.batch_size, lr=self.lr, stage2_lr=self.stage2_lr,
                    warmup=self.warmup, eval_scenes=self.eval_scenes, text_steps=self.text_steps)  # fmt: skip
        for key in ("stage1_steps", "stage2_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"vlm.{key} must be 0 (skip) or more, got {getattr(self, key)}")


@dataclasses.dataclass(frozen=True)
class VLMRunConfig:
    """A VLM run: the LM's shape (vocab_size is set from the encoder's vocabulary) and phases."""

    lm: ModelConfig = dataclasses.field(
        default_factory=lambda: ModelConfig(
            vocab_size=128, context_length=128, d_model=128, n_layers=4, n_heads=4
        )
    )
    "the language model (vocab_size is replaced by the tokenizer's)"
    vlm: VLMConfig = dataclasses.field(default_factory=VLMConfig)
    "phases and evaluation"


def load_encoder(folder: str | Path):
    """(ViT, WordTokenizer, the run's ContrastiveRunConfig) from a ``vision pretrain`` folder
    (the weights of its latest checkpoint)."""
    from lmforge.checkpoint import latest_checkpoint, load_model_state
    from lmforge.vision.contrastive import ContrastiveRunConfig, build_dual_encoder
    from lmforge.vision.data import WordTokenizer

    folder = Path(folder)
    for name in ("config.toml", "vocab.json"):
        if not (folder / name).is_file():
            raise LmforgeError(f"{folder} is not a `vision pretrain` run (no {name})")
    ckpt = latest_checkpoint(folder / "train") if (folder / "train").is_dir() else None
    if ckpt is None:
        raise LmforgeError(f"{folder} is not a `vision pretrain` run (no train/checkpoints)")
    cfg = load_config(ContrastiveRunConfig, folder / "config.toml")
    tok = WordTokenizer.load(folder / "vocab.json")
    model = build_dual_encoder(cfg, tok)
    model.load_state_dict(load_model_state(Path(ckpt) / "model.safetensors"))
    return model.vision, tok, cfg


def run_vlm(
    cfg: VLMRunConfig, encoder: str | Path, log: Callable[[dict], None] = print
) -> dict[str, dict[str, float]]:
    """All phases, each an objective in the Trainer (its folder ``cfg.vlm.out/<phase>``: a rerun
    resumes there); writes ``cfg.vlm.out`` and returns {phase: accuracies}."""
    from lmforge.model import TransformerLM
    from lmforge.vision._train import phase_train_config, run_phase
    from lmforge.vision.contrastive import pick_device
    from lmforge.vision.vlm import VisionLanguageModel, VLMObjective, question_accuracy

    v = cfg.vlm
    if v.threads:
        torch.set_num_threads(v.threads)
    out = Path(v.out)
    device = pick_device(v.device)
    vit, tok, enc_cfg = load_encoder(encoder)
    lm_cfg = dataclasses.replace(cfg.lm, vocab_size=tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, lm=lm_cfg), out / "config.toml")
    # what serving needs beside the weights (lmforge.vision.serving.load_vlm reads them)
    save_config(enc_cfg.vision, out / "vision.toml")
    tok.save(out / "vocab.json")
    size = enc_cfg.vision.image_size
    train = ProceduralScenes(seed=v.seed, split="train", image_size=size, max_objects=v.max_objects)
    val = ProceduralScenes(seed=v.seed, split="val", image_size=size, max_objects=v.max_objects)
    n_img = enc_cfg.vision.n_patches
    bf16 = torch.device(device).type == "cuda"  # autocast on CUDA; fp32 on the CPU
    results: dict[str, dict[str, float]] = {}

    def fit(name: str, objective, model, steps: int, lr: float) -> None:
        tc = phase_train_config(out / name, steps=steps, lr=lr, warmup=v.warmup,
                                batch_size=v.batch_size, device=device, seed=v.seed,
                                precision="bf16" if bf16 else "fp32")  # fmt: skip
        run_phase(objective, model, tc, lambda r: log({"phase": name, **r}))

    def phase(name: str, model, target: str, steps: int, lr: float) -> None:
        objective = VLMObjective(train, tok, n_img, v.batch_size, "image", target, name, bf16)
        fit(name, objective, model, steps, lr)
        results[name] = question_accuracy(model, val, tok, "image", n_img, v.eval_scenes)
        log({"phase": name, **results[name]})

    torch.manual_seed(v.seed)
    lm = TransformerLM(lm_cfg)
    # the text LM sees both formats, so one model is the upper bound (with the caption) and
    # a fair lower bound (question alone, the priors it learned); trained on a 50/50 mix
    mixed = _MixedObjective(
        VLMObjective(train, tok, n_img, v.batch_size // 2, "caption", "answer", "text", bf16),
        VLMObjective(
            ProceduralScenes(v.seed, "train-q", size, v.max_objects),
            tok,
            n_img,
            v.batch_size - v.batch_size // 2,
            "none",
            "answer",
            "text",
            bf16,
        ),
    )
    fit("text", mixed, lm, v.text_steps, v.lr)
    for ctx, label in (("caption", "upper"), ("none", "lower")):
        results[label] = question_accuracy(lm, val, tok, ctx, n_img, v.eval_scenes)
        log({"phase": label, **results[label]})

    vlm = VisionLanguageModel(vit, lm, tok.image_id).to(device)
    # frozen parts have requires_grad off: the Trainer gives only the rest to AdamW
    vlm.vision.requires_grad_(False)
    if v.stage1_steps:
        vlm.lm.requires_grad_(False)
        phase("stage1", vlm, "caption", v.stage1_steps, v.lr)
    if v.stage2_steps:
        vlm.lm.requires_grad_(True)
        phase("stage2", vlm, "answer", v.stage2_steps, v.stage2_lr)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    return results


class _MixedObjective:
    """Two objectives' batches side by side (same target kind), one loss: summed token losses
    over summed target tokens."""

    name = "text"

    def __init__(self, a, b) -> None:
        self.parts = (a, b)

    def next_batch(self):
        """Both parts' batches."""
        return [p.next_batch() for p in self.parts]

    def batch_weight(self, batch) -> float:
        """Target tokens of both parts."""
        return sum(p.batch_weight(b) for p, b in zip(self.parts, batch, strict=True))

    def loss(self, model, batch):
        """Summed token losses and token counts of both parts."""
        pairs = [p.loss(model, b) for p, b in zip(self.parts, batch, strict=True)]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def state_dict(self) -> dict:
        """Both parts' positions."""
        return {"a": self.parts[0].state_dict(), "b": self.parts[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore both positions."""
        self.parts[0].load_state_dict(state["a"])
        self.parts[1].load_state_dict(state["b"])
