"""Post-training quantization of a whole model with a calibration method: rtn, awq, gptq,
smoothquant.

:func:`quantize_calibrated` walks ``model.layers`` with a :class:`~lmforge.quant.calib.
BlockRunner`: for each block it collects what the method needs from its linears' inputs on the
calibration tokens (GPTQ: the Hessian ``2 X Xᵀ / n``, formed once per input tensor that several
linears share; AWQ and SmoothQuant: per-channel |x| statistics and a row sample), swaps the
block's linears for quantized modules, and runs the quantized block to produce the next block's
inputs. Linears outside the blocks (an unskipped LM head) are rounded to nearest. The model is
changed in place.
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
from lmforge.quant.smoothquant import smooth_scales, smooth_search
from lmforge.utils.errors import LmforgeError

__all__ = ["METHODS", "CalibOptions", "quantize_calibrated"]

METHODS = ("rtn", "awq", "gptq", "smoothquant")


@dataclasses.dataclass(frozen=True)
class CalibOptions:
    """Knobs of the calibrated methods (defaults: the papers', plus GPTQ's diag(H)-weighted clip
    search and SmoothQuant's per-group α search, measured best on SmolLM2-135M in
    ``benchmarks/RESULTS.md``)."""

    batch_size: int = 8
    "calibration samples per forward"
    gptq_damp: float = 0.01
    "GPTQ: damping added to diag(H), as a fraction of its mean"
    gptq_act_order: bool = True
    "GPTQ: quantize columns by decreasing diag(H)"
    gptq_block_size: int = 128
    "GPTQ: columns per lazy batch update"
    gptq_clip_grid: int = 100
    "GPTQ: steps of the group range search (int4) or channel scale search (fp8); 0 = min/max"
    gptq_clip_weighted: bool = True
    "GPTQ: weight that search's error by diag(H) (else plain weight error, GPTQ's mse option)"
    awq_grid: int = 20
    "AWQ: α steps in [0, 1]"
    smooth_alpha: float = 0.5
    "SmoothQuant: migration strength α"
    smooth_alpha_grid: int = 10
    "SmoothQuant: > 0 searches α per group on this grid (and no migration) for the W8A8 error"


def check_method(method: str, spec: QuantSpec) -> None:
    """One line unless ``method`` exists and applies to ``spec``'s format."""
    if method not in METHODS:
        raise LmforgeError(f"unknown quantization method {method!r} ({', '.join(METHODS)})")
    w8a8 = spec.format == "fp8" and spec.fp8_activations == "dynamic"
    if method == "smoothquant" and not w8a8:
        raise LmforgeError("smoothquant prepares W8A8: use it with --format fp8 --bits 8")


def _block_linears(model: nn.Module, i: int, skip: tuple[str, ...]) -> list[str]:
    prefix = f"layers.{i}."
    return [n[len(prefix) :] for n in find_linears(model, skip) if n.startswith(prefix)]


def _hessians(runner: BlockRunner, block: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(names, 0)
    last: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, Xᵀ X) of the latest input

    def visit(name: str, x: torch.Tensor) -> None:
        # q/k/v (and w1/w3) read one tensor: its product is formed once (x stays referenced,
        # so an equal pointer is the same live tensor, not a later one in its memory)
        prev = last[0][0] if last else None
        if prev is not None and (prev.data_ptr(), prev.shape, prev.stride()) == (
            x.data_ptr(),
            x.shape,
            x.stride(),
        ):
            xtx = last[0][1]
        else:
            xf = x.float()
            xtx = xf.t() @ xf  # (K, K)
            last[:] = [(x, xtx)]
        sums[name] = xtx if name not in sums else sums[name] + xtx
        counts[name] += x.shape[0]

    runner.inputs_of(block, names, visit)
    return {n: 2.0 * sums[n] / counts[n] for n in sums}  # a linear never called has none


def _gptq_linear(
    w: torch.Tensor, hessian: torch.Tensor | None, spec: QuantSpec, options: CalibOptions
) -> nn.Module:
    if hessian is None:  # never called on the calibration text: nothing to correct against
        return quantize_linear(w, spec)
    return gptq_quantize(
        w,
        hessian,
        bits=spec.bits,
        group_size=spec.group_for(w.shape[1]),
        symmetric=spec.symmetric,
        damp=options.gptq_damp,
        act_order=options.gptq_act_order,
        block_size=options.gptq_block_size,
        clip_grid=options.gptq_clip_grid,
        clip_weighted=options.gptq_clip_weighted,
        fp8=spec.fp8_activations if spec.format == "fp8" else None,
        fp8_per_channel=spec.fp8_per_channel,
    )


def _stats(runner: BlockRunner, block: nn.Module, names: list[str]) -> dict[str, ActStats]:
    stats = {n: ActStats(calls=len(runner.states)) for n in names}
    runner.inputs_of(block, names, lambda n, x: stats[n].add(x))
    return stats


def _migrate(
    runner: BlockRunner,
    block: nn.Module,
    names: list[str],
    method: str,
    spec: QuantSpec,
    options: CalibOptions,
) -> dict[str, torch.Tensor]:
    """AWQ's or SmoothQuant's per-input-channel scales, applied to the block's float weights;
    returns the scales that could not be folded (name -> s) for the modules' input_scale."""
    groups = scale_groups(block, names)
    stats = _stats(runner, block, [g.linears[0] for g in groups])
    input_scale: dict[str, torch.Tensor] = {}
    for g in groups:
        ws = [block.get_submodule(n).weight for n in g.linears]
        st = stats[g.linears[0]]
        if method == "awq":
            s = awq_scales(ws, st, spec, options.awq_grid)
        elif options.smooth_alpha_grid:
            s = smooth_search(ws, st, spec, options.smooth_alpha_grid)
        else:
            s = smooth_scales(ws, st, options.smooth_alpha)
        kept = apply_scales(block, g, s)
        if kept is not None:
            input_scale.update(dict.fromkeys(g.linears, kept))
    return input_scale


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
                new[n] = _gptq_linear(block.get_submodule(n).weight, hess.get(n), spec, options)
        else:
            input_scale = _migrate(runner, block, names, method, spec, options)
            for n in names:
                new[n] = quantize_linear(block.get_submodule(n).weight, spec)
                if n in input_scale:
                    new[n].set_input_scale(input_scale[n])
        replace_linears(block, new)
        done.update(f"layers.{i}.{n}" for n in names)
        runner.advance(block)
    rest = {n: m for n, m in find_linears(model, spec.skip).items() if n not in done}
    return replace_linears(model, {n: quantize_linear(m.weight, spec) for n, m in rest.items()})
