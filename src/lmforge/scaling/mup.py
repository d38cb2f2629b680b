"""muP evidence: the coordinate check and a learning-rate transfer sweep across widths.

Both train a family of widths (n_heads fixed, so the head width E grows with d_model and the 1/E
attention scale matters) on one synthetic, learnable token stream in the one
:class:`~lmforge.train.Trainer` (an objective over in-memory windows), whose AdamW parameter
groups carry :func:`lmforge.model.mup.lr_multipliers`.

- :func:`coord_check`: the mean |x| of the embedding output, every block's output and the logits
  over the first steps, per width, standard vs muP. Under muP the curves stay flat in width; under
  the standard parametrization the logits (and later the hidden states) grow with width.
- :func:`lr_sweep`: final training loss per (width, LR). Under muP the best LR of the smallest
  width stays best at 4–8× the width; under the standard parametrization it drifts down.

Simplification: no warm-up, decay, weight decay or clipping (constant LR), fp32, a synthetic
stream instead of text.
Exercised by ``pytest tests/test_scaling_mup.py`` and ``lmforge scaling coord-check``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _stream(vocab: int, n: int, seed: int) -> Any:
    import torch

    # A repeating 37-token cycle with 20% random tokens: learnable within a few dozen steps.
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n) % 37
    noise = torch.randint(0, vocab, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.2, noise, base)


def family_config(
    width: int,
    mup: bool,
    base_width: int,
    n_layers: int = 2,
    n_heads: int = 4,
    vocab: int = 256,
    context: int = 64,
) -> Any:
    """The coord-check family: fixed depth and heads, E = width / heads."""
    from lmforge.model.config import ModelConfig

    return ModelConfig(
        vocab_size=vocab,
        context_length=context,
        d_model=width,
        n_layers=n_layers,
        n_heads=n_heads,
        mup=mup,
        mup_base_width=base_width,
        mup_base_head_dim=base_width // n_heads,
        attention="reference",
    )


class _Windows:
    """The given (x, y) batches in order: the sampler a :class:`~lmforge.train.LMObjective`
    draws from (its position is the objective's state)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.pos = batches, 0

    def next_batch(self, batch_size: int, device: str) -> Any:
        self.pos += 1
        return self.batches[self.pos - 1]

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


def _cross_entropy(model: Any, x: Any, y: Any) -> Any:
    import torch

    logits = model(x)  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _train(model: Any, cfg: Any, batches: list, lr: float, seed: int, device: str) -> list[float]:
    """One step per (x, y) batch, in order, of the one :class:`~lmforge.train.Trainer` (whose
    AdamW carries muP's per-parameter LR multipliers): mean next-token cross-entropy, constant
    ``lr``, no warm-up, decay, weight decay or clipping, fp32, in a throw-away run folder.
    Returns each step's loss; a non-finite one is kept (the Trainer skips that update and goes
    on to the last step)."""
    import contextlib
    import io
    import tempfile

    from lmforge.config import RunConfig
    from lmforge.train import LMObjective, TrainConfig, Trainer

    steps = len(batches)
    losses: list[float] = []
    with tempfile.TemporaryDirectory(prefix="lmforge-mup-") as out:
        tc = TrainConfig(out_dir=out, device=device, seed=seed, precision="fp32", lr=lr,
                         min_lr=0.0, schedule="constant", warmup_steps=0, weight_decay=0.0,
                         grad_clip=0.0, max_steps=steps, batch_size=len(batches[0][0]),
                         eval_every=0, save_every=0, save_every_minutes=0.0, log_every=steps,
                         keep_last=1, resume=False, max_bad_steps=steps + 1, progress=False,
                         plot=False)  # fmt: skip

        def keep(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
            losses.append(float(metrics["loss"]))

        objective = LMObjective(_Windows(batches), len(batches[0][0]), device, _cross_entropy)
        # A sweep is dozens of runs: their start lines ("no checkpoint in /tmp/...") are noise.
        with contextlib.redirect_stderr(io.StringIO()):
            Trainer(RunConfig(model=cfg, train=tc), model=model, objective=objective,
                    callbacks=[keep]).run()  # fmt: skip
    return losses


def _batches(stream: Any, batch: int, context: int, steps: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - context - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(context + 1)[None, :]  # (B, T+1)
        win = stream[idx]
        out.append((win[:, :-1], win[:, 1:]))
    return out


def _recorder(record: dict[str, float], key: str, history: list | None = None) -> Any:
    # A forward hook storing the output's mean |x| under ``key`` (then, with ``history``, a
    # copy of the whole record: the model's own hook runs after its modules' hooks).
    def hook(module: Any, inputs: Any, output: Any) -> None:
        if isinstance(output, tuple):  # a cross-layer KV sharing block: (x, its K/V)
            output = output[0]
        record[key] = float(output.detach().abs().mean())
        if history is not None:
            history.append(dict(record))

    return hook


def coord_check(
    widths: Sequence[int],
    steps: int = 5,
    lr: float = 1e-2,
    base_width: int | None = None,
    batch: int = 8,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, dict[str, dict[int, list[float]]]]:
    """``{"standard"|"mup": {site: {width: [mean |x| after step 0..steps-1]}}}``.

    Sites: ``embedding``, ``block_{i}`` (residual stream after block i) and ``logits``; each
    value is measured in the forward pass of step t (so step 0 is the initialisation).
    """
    import torch

    from lmforge.model import TransformerLM

    base = base_width or min(widths)
    out: dict[str, dict[str, dict[int, list[float]]]] = {}
    for name, mup in (("standard", False), ("mup", True)):
        sites: dict[str, dict[int, list[float]]] = {}
        for w in widths:
            cfg = family_config(w, mup, base)
            torch.manual_seed(seed)
            model = TransformerLM(cfg, device=device)
            record: dict[str, float] = {}
            history: list[dict[str, float]] = []  # the forward of step t, before its update
            hooks = [model.token_embeddings.register_forward_hook(_recorder(record, "embedding"))]
            for li, layer in enumerate(model.layers):
                hooks.append(layer.register_forward_hook(_recorder(record, f"block_{li}")))
            hooks.append(model.register_forward_hook(_recorder(record, "logits", history)))
            data = _batches(
                _stream(cfg.vocab_size, 20000, seed), batch, cfg.context_length, steps, seed
            )
            _train(model, cfg, [(x.to(device), y.to(device)) for x, y in data], lr, seed, device)
            for h in hooks:
                h.remove()
            for seen in history:
                for k, v in seen.items():
                    sites.setdefault(k, {}).setdefault(w, []).append(v)
        out[name] = sites
    return out


def lr_sweep(
    widths: Sequence[int],
    lrs: Sequence[float],
    mup: bool,
    steps: int = 100,
    base_width: int | None = None,
    batch: int = 8,
    seed: int = 0,
    device: str = "cpu",
    n_layers: int = 2,
    stream: Any = None,
    context: int = 64,
) -> dict[int, dict[float, float]]:
    """{width: {lr: mean training loss of the last 10% of steps}} (inf for a diverged run).

    ``stream`` (a 1-D tensor of token ids, e.g. a text shard) replaces the synthetic stream.
    """
    import math

    import torch

    from lmforge.model import TransformerLM

    base = base_width or min(widths)
    out: dict[int, dict[float, float]] = {}
    for w in widths:
        vocab = 256 if stream is None else int(stream.max()) + 1
        cfg = family_config(w, mup, base, n_layers=n_layers, vocab=vocab, context=context)
        src = _stream(vocab, 200000, seed) if stream is None else stream
        data = _batches(src, batch, cfg.context_length, steps, seed)
        data = [(x.to(device), y.to(device)) for x, y in data]
        out[w] = {}
        for lr in lrs:
            torch.manual_seed(seed)
            model = TransformerLM(dataclasses.replace(cfg, attention="sdpa"), device=device)
            losses = _train(model, cfg, data, lr, seed, device)
            tail = torch.tensor(losses[steps - max(steps // 10, 1) :])  # float32, as the losses
            value = float(tail.mean())
            out[w][lr] = value if math.isfinite(value) else math.inf
    return out


def best_lrs(sweep: dict[int, dict[float, float]]) -> dict[int, float]:
    """The LR of the lowest loss per width."""
    return {w: min(row, key=row.get) for w, row in sweep.items()}


def plot_coord_check(result: dict, path: str | Path, lr: float) -> None:
    """Mean |x| against width, one line per step, for standard and muP (rows) and sites (columns)."""
    from lmforge.scaling.plot import _pyplot, _save_png

    plt = _pyplot()
    sites = list(result["standard"])
    fig, axes = plt.subplots(2, len(sites), figsize=(3.2 * len(sites), 6), squeeze=False)
    for row, name in enumerate(("standard", "mup")):
        for col, site in enumerate(sites):
            ax = axes[row][col]
            by_w = result[name][site]
            widths = sorted(by_w)
            steps = len(by_w[widths[0]])
            for t in range(steps):
                ax.plot(
                    widths,
                    [by_w[w][t] for w in widths],
                    marker="o",
                    ms=3,
                    color=plt.cm.plasma(t / max(steps - 1, 1)),
                    label=f"step {t}",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {site}", fontsize=9)
            if col == 0:
                ax.set_ylabel("mean |x|")
            if row == 1:
                ax.set_xlabel("width d_model")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"coordinate check, AdamW lr={lr:g} (flat in width = muP working)")
    _save_png(fig, path, dpi=100)


def plot_lr_sweep(sp: dict, mup: dict, path: str | Path) -> None:
    """Final loss against LR per width: standard (left) vs muP (right), best LR marked."""
    import math

    from lmforge.scaling.plot import _pyplot, _save_png

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, name, sweep in ((axes[0], "standard", sp), (axes[1], "muP", mup)):
        widths = sorted(sweep)
        for i, w in enumerate(widths):
            lrs = sorted(sweep[w])
            ys = [sweep[w][lr] if math.isfinite(sweep[w][lr]) else math.nan for lr in lrs]
            col = plt.cm.viridis(i / max(len(widths) - 1, 1))
            ax.plot(lrs, ys, marker="o", ms=3, color=col, label=f"d={w}")
            best = min(sweep[w], key=sweep[w].get)
            ax.scatter(
                [best], [sweep[w][best]], marker="*", s=120, color=col, edgecolor="k", zorder=3
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"{name}: loss vs LR (★ = best)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training loss (last 10% of steps)")
    _save_png(fig, path, dpi=100)
