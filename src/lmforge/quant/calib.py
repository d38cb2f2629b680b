"""Calibration data and the block-by-block pass the calibrated methods share.

:func:`calibration_tokens` turns a text file into N samples of T tokens (evenly spaced windows of
the token stream, so the samples cover the whole file). :class:`BlockRunner` feeds them through
the model one Transformer block at a time: the inputs of ``model.layers[0]`` are captured once
(with the arguments the model passes to a block, whatever they are), then each block is run on
the current hidden states with forward hooks on its linears collecting their inputs, the method
quantizes the block, and the block is run again — now quantized — to give the next block its
inputs (GPTQ's sequential order: later layers correct for the earlier layers' error). Only one
block's activations are held at a time.

Shape legend: N samples, T tokens per sample, D model dim, K a linear's input width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.utils.errors import LmforgeError

__all__ = ["BlockRunner", "calibration_tokens"]


def calibration_tokens(
    path: str | Path, tokenizer: Any, n_samples: int = 128, seq_len: int = 512
) -> torch.Tensor:
    """(N, T) long token ids: ``n_samples`` evenly spaced windows of ``seq_len`` tokens of the
    text file at ``path`` encoded by ``tokenizer``. A missing, binary or too short file is one
    :class:`LmforgeError` line."""
    p = Path(path)
    if n_samples < 1 or seq_len < 2:
        raise LmforgeError(
            f"calibration needs >= 1 sample of >= 2 tokens, got {n_samples}×{seq_len}"
        )
    if not p.is_file():
        raise LmforgeError(f"calibration file not found: {p}")
    if tokenizer is None:
        raise LmforgeError("the model has no tokenizer to encode the calibration text with")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LmforgeError(f"cannot read calibration file {p} as UTF-8 text: {e}") from None
    need = n_samples * seq_len
    # encode only what is needed (about 4 bytes per token; 8× headroom, then everything)
    ids: list[int] = tokenizer.encode(text[: need * 32]) if len(text) > need * 32 else []
    if len(ids) < need:
        ids = tokenizer.encode(text)
    if len(ids) < need:
        raise LmforgeError(
            f"calibration file {p} has {len(ids)} tokens; {n_samples} samples × {seq_len} tokens "
            f"need {need} (give a longer text or fewer/shorter samples)"
        )
    stream = torch.tensor(ids, dtype=torch.long)
    starts = torch.linspace(0, len(ids) - seq_len, n_samples).long()  # (N,)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])  # (N, T)


class _Captured(Exception):
    """Raised by the capture hook to stop the forward after layers[0]'s inputs are known."""


class BlockRunner:
    """Calibration hidden states moved through ``model.layers`` one block at a time.

    ``tokens`` (N, T) are split into batches of ``batch_size`` samples; the states live on the
    model's device. Use :meth:`inputs_of` to collect the inputs of a block's linears, then
    :meth:`advance` to run the (possibly now quantized) block and move the states on.
    """

    def __init__(self, model: nn.Module, tokens: torch.Tensor, batch_size: int = 8) -> None:
        if getattr(getattr(model, "config", None), "kv_share_every", 1) > 1:
            raise LmforgeError(
                "calibrated quantization runs one block at a time, and a cross-layer KV sharing"
                " consumer (model.kv_share_every > 1) needs its producer's keys/values: use"
                " --method rtn"
            )
        self.model = model
        self.device = next(model.parameters()).device
        self.states: list[torch.Tensor] = []
        self.extra: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        first = model.layers[0]

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.states.append(args[0].detach())
            self.extra.append((args[1:], kwargs))
            raise _Captured

        handle = first.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                for batch in tokens.split(batch_size):
                    with contextlib.suppress(_Captured):
                        model(batch.to(self.device))
        finally:
            handle.remove()

    def _run(self, block: nn.Module) -> Iterator[torch.Tensor]:
        with torch.no_grad():
            for x, (args, kwargs) in zip(self.states, self.extra, strict=True):
                yield block(x, *args, **kwargs)

    def inputs_of(
        self, block: nn.Module, names: list[str], visit: Callable[[str, torch.Tensor], None]
    ) -> None:
        """Run ``block`` on the states, calling ``visit(name, x (rows, K))`` with the input of
        each submodule in ``names`` (every batch, every call)."""
        handles = []
        for name in names:

            def hook(_m: nn.Module, args: tuple[Any, ...], _out: Any, name: str = name) -> None:
                x = args[0].detach()
                visit(name, x.reshape(-1, x.shape[-1]))  # (B·T, K)

            handles.append(block.get_submodule(name).register_forward_hook(hook))
        try:
            for _ in self._run(block):
                pass
        finally:
            for h in handles:
                h.remove()

    def advance(self, block: nn.Module) -> None:
        """Replace the states by ``block``'s outputs (the next block's inputs)."""
        self.states = list(self._run(block))
