"""The bridge until the one Trainer runs objectives: a minimal driver for one objective (the
``lmforge.train.objective`` contract) on one device — a step per micro-batch, an LR schedule,
gradient clipping, periodic ``evaluate``, and a resumable checkpoint (weights and AdamW state as
safetensors, the objective's position as JSON). At merge the lead replaces :func:`run_objective`
with ``Trainer`` in its three callers (``pretrain``, ``run_vlm``, ``run_vq``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge import checkpoint as ckpt
from lmforge.utils.io import atomic_write_text


def _save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, write in (("model", ckpt.save_model_state), ("optimizer", ckpt.save_optimizer_state)):
        tmp = folder / f".{name}.safetensors.tmp"
        write(tmp, model.state_dict() if name == "model" else optimizer)
        os.replace(tmp, folder / f"{name}.safetensors")
    atomic_write_text(folder / "state.json", json.dumps(state))  # last: marks a whole checkpoint


def run_objective(
    objective: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    lr_at: Callable[[int], float] | None = None,
    grad_clip: float = 1.0,
    out: str | os.PathLike | None = None,
    save_every: int = 0,
    eval_every: int = 0,
    log: Callable[[dict], None] = lambda record: None,
) -> dict[str, float]:
    """Train ``model`` on ``objective`` for ``steps`` steps (resuming from a checkpoint in ``out``);
    returns the final evaluation (``{}`` without ``objective.evaluate``)."""
    from tqdm import tqdm

    folder = Path(out) if out is not None else None
    start = 0
    if folder is not None and (folder / "state.json").is_file():
        state = json.loads((folder / "state.json").read_text())
        model.load_state_dict(ckpt.load_model_state(folder / "model.safetensors"))
        ckpt.load_optimizer_state(folder / "optimizer.safetensors", optimizer)
        objective.load_state_dict(state["objective"])
        start = state["step"]
    evaluate = getattr(objective, "evaluate", None)
    for step in tqdm(range(start, steps), desc=objective.name, initial=start, total=steps):
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
        model.train()
        loss_sum, weight = objective.loss(model, objective.next_batch())
        loss = loss_sum / weight.clamp(min=1e-12)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        extra = getattr(objective, "metrics", dict)()
        log({"step": step + 1, "loss": loss.item(), "grad_norm": norm.item(), **extra})
        done = step + 1
        if evaluate is not None and eval_every and done % eval_every == 0 and done < steps:
            log({"step": done, **evaluate(model)})
        if folder is not None and save_every and (done % save_every == 0 or done == steps):
            _save(folder, model, optimizer, {"step": done, "objective": objective.state_dict()})
    result = evaluate(model) if evaluate is not None else {}
    log({"step": steps, **result})
    return result
