"""Post-training quantization of a whole model with a calibration method: rtn, awq, gptq,
smoothquant.

:func:`quantize_calibrated` walks ``model.layers`` with a :class:`~lmforge.quant.calib.
BlockRunner`: for each block it collects what the method needs from its linears' inputs on the
calibration tokens (GPTQ: the Hessian ``2 X Xᵀ / n``; AWQ and SmoothQuant: per-channel |x|
statistics and a row sample), swaps the block's linears for quantized modules, and runs the
quantized block to produce the next block's inputs. Linears outside the blocks (an unskipped LM
head) are rounded to nearest. The model is changed in place.
Exercised by ``pytest tests/test_quant_calib.py`` and ``lmforge quantize``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmforge.quant.apply import (
    QuantSpec,
    check_spec,
    find_linears,
    quantize_linear,
    replace_linears,
)
from lmforge.quant.awq import ActStats, apply_scales, awq_scales, scale_groups
from lmforge.quant.calib import BlockRunner
from lmforge.quant.gptq import gptq_quantize
from lmforge.quant.smoothquant import smooth_scales
from lmforge.utils.errors import LmforgeError

__all__ = ["METHODS", "CalibOptions", "quantize_calibrated"]

METHODS = ("rtn", "awq", "gptq", "smoothquant")


@dataclasses.dataclass(frozen=True)
class CalibOptions:
    """Knobs of the calibrated methods (defaults are the papers')."""

    batch_size: int = 8
    "calibration samples per forward"
    gptq_damp: float = 0.01
    "GPTQ: damping added to diag(H), as a fraction of its mean"
    gptq_act_order: bool = True
    "GPTQ: quantize columns by decreasing diag(H)"
    gptq_block_size: int = 128
    "GPTQ: columns per lazy batch update"
    awq_grid: int = 20
    "AWQ: α steps in [0, 1]"
    smooth_alpha: float = 0.5
    "SmoothQuant: migration strength α"


def check_method(method: str, spec: QuantSpec) -> None:
    """One line unless ``method`` exists and applies to ``spec``'s format."""
    if method not in METHODS:
        raise LmforgeError(f"unknown quantization method {method!r} ({', '.join(METHODS)})")
    if method == "gptq" and spec.format == "fp8":
        raise LmforgeError("gptq quantizes to int4/int8 grids, not fp8 (use --format int)")
    if method == "smoothquant" and not (spec.format == "fp8" and spec.fp8_activations == "dynamic"):
        raise LmforgeError("smoothquant prepares W8A8: use it with --format fp8 --bits 8")


def _block_linears(model: nn.Module, i: int, skip: tuple[str, ...]) -> list[str]:
    prefix = f"layers.{i}."
    return [n[len(prefix) :] for n in find_linears(model, skip) if n.startswith(prefix)]


def _hessians(runner: BlockRunner, block: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(names, 0)

    def visit(name: str, x: torch.Tensor) -> None:
        xf = x.float()
        xtx = xf.t() @ xf  # (K, K)
        sums[name] = xtx if name not in sums else sums[name] + xtx
        counts[name] += x.shape[0]

    runner.inputs_of(block, names, visit)
    return {n: 2.0 * sums[n] / max(counts[n], 1) for n in names}


def _stats(runner: BlockRunner, block: nn.Module, names: list[str]) -> dict[str, ActStats]:
    stats = {n: ActStats(calls=len(runner.states)) for n in names}
    runner.inputs_of(block, names, lambda n, x: stats[n].add(x))
    return stats


@torch.no_grad()
def quantize_calibrated(
    model: nn.Module,
    spec: QuantSpec,
    method: str,
    tokens: torch.Tensor | None,
    options: CalibOptions = CalibOptions(),
    progress: bool = False,
) -> nn.Module:
    """Quantize ``model``'s linears in place with ``method`` on calibration ``tokens`` (N, T)
    (None is allowed for rtn); returns ``model``."""
    check_method(method, spec)
    check_spec(model, spec)
    if method == "rtn":
        return replace_linears(
            model,
            {n: quantize_linear(m.weight, spec) for n, m in find_linears(model, spec.skip).items()},
        )
    if tokens is None:
        raise LmforgeError(f"{method} needs calibration text (--calib FILE)")
    runner = BlockRunner(model, tokens, options.batch_size)
    layers = range(len(model.layers))
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc=f"{method} blocks", unit="block")
    done: set[str] = set()
    for i in layers:
        block = model.layers[i]
        names = _block_linears(model, i, spec.skip)
        new: dict[str, nn.Module] = {}
        if method == "gptq":
            hess = _hessians(runner, block, names)
            for n in names:
                w = block.get_submodule(n).weight
                new[n] = gptq_quantize(
                    w,
                    hess[n],
                    bits=spec.bits,
                    group_size=spec.group_for(w.shape[1]),
                    symmetric=spec.symmetric,
                    damp=options.gptq_damp,
                    act_order=options.gptq_act_order,
                    block_size=options.gptq_block_size,
                )
        else:
            groups = scale_groups(block, names)
            stats = _stats(runner, block, [g.linears[0] for g in groups])
            input_scale: dict[str, torch.Tensor] = {}
            for g in groups:
                ws = [block.get_submodule(n).weight for n in g.linears]
                st = stats[g.linears[0]]
                if method == "awq":
                    s = awq_scales(ws, st, spec, options.awq_grid)
                else:
                    s = smooth_scales(ws, st, options.smooth_alpha)
                kept = apply_scales(block, g, s)
                if kept is not None:
                    input_scale.update(dict.fromkeys(g.linears, kept))
            for n in names:
                new[n] = quantize_linear(block.get_submodule(n).weight, spec)
                if n in input_scale:
                    new[n].set_input_scale(input_scale[n])
        replace_linears(block, new)
        done.update(f"layers.{i}.{n}" for n in names)
        runner.advance(block)
    rest = {n: m for n, m in find_linears(model, spec.skip).items() if n not in done}
    return replace_linears(model, {n: quantize_linear(m.weight, spec) for n, m in rest.items()})
