"""How every vision phase trains: its objective in the one :class:`~lmforge.train.Trainer`.

Contrastive pretraining, the VLM's text LM and stages 1 and 2, the VQ-VAE and the image-token
LM are objectives (``lmforge.train.objective``); this module maps a phase's own config keys
(steps, lr, warm-up, ...) onto a ``[train]`` branch and runs the Trainer, so every phase gets
the Trainer's AdamW, its cosine schedule (warm-up, then down to lr/10), gradient clipping,
``metrics.jsonl``, ``loss_curve.png``, checkpoints and exact resume. Frozen parts of a model
(``requires_grad=False``) are not given to the optimizer. Exercised by
``pytest tests/test_vision_pretrain.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from lmforge.train import TrainConfig


def phase_train_config(
    out_dir: str | Path,
    *,
    steps: int,
    lr: float,
    warmup: int,
    batch_size: int,
    device: str,
    seed: int,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    grad_clip: float = 1.0,
    eval_every: int = 0,
    save_every: int = 0,
    precision: str = "fp32",
    plot: bool = True,
) -> TrainConfig:
    """The ``[train]`` branch of one vision phase: cosine from ``lr`` to ``lr / 10`` after
    ``warmup`` linear steps, a metrics line per step, a checkpoint every ``save_every`` steps
    (0 = at the end only). ``precision`` is recorded only: objectives choose their autocast.
    ``plot`` (loss_curve.png) must be off for an objective with its own ``evaluate``: the
    Trainer's plot reads ``val_loss`` from every eval record."""
    from lmforge.train import TrainConfig

    return TrainConfig(
        out_dir=str(out_dir),
        device=device,
        seed=seed,
        batch_size=batch_size,
        max_steps=steps,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=warmup,
        schedule="cosine",
        beta1=betas[0],
        beta2=betas[1],
        eps=eps,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        precision=precision,  # type: ignore[arg-type]
        eval_every=eval_every,
        save_every=save_every,
        log_every=1,
        plot=plot,
    )


def run_phase(
    objective: Any,
    model: nn.Module,
    train: TrainConfig,
    log: Callable[[dict], None] = lambda record: None,
    callbacks: Sequence[Callable[..., None]] = (),
) -> dict[str, Any]:
    """Train ``model`` on ``objective`` in the Trainer (resuming from ``train.out_dir``);
    ``log`` gets ``{"step", "loss", "lr", "grad_norm", ...objective metrics}`` after every step.
    Returns the Trainer's final result (with the objective's final ``evaluate``, if any)."""
    from lmforge.config import RunConfig
    from lmforge.train import Trainer

    def forward(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        log({"step": step, **{k: v for k, v in metrics.items() if k != "skipped"}})

    trainer = Trainer(
        RunConfig(train=train), model=model, objective=objective, callbacks=[*callbacks, forward]
    )
    return trainer.run()


def check_phase(section: str, **values: float) -> None:
    """Refuse at config load what the Trainer would refuse later, in one line naming
    ``section.key`` (``key`` alone for an empty section): ``warmup``, ``*_every``,
    ``weight_decay``, ``grad_clip`` and ``z_loss`` must be 0 or more, the rest positive."""
    for key, v in values.items():
        name = f"{section}.{key}" if section else key
        if key in ("warmup", "weight_decay", "grad_clip", "z_loss") or key.endswith("every"):
            if v < 0:
                raise ValueError(f"{name} must be 0 or more, got {v}")
        elif v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
