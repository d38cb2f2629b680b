"""Calibrated quantization: GPTQ's fast path equals the literal OBS algorithm, GPTQ and AWQ beat
round-to-nearest where they should, scale folding preserves the function, the calibration token
stream and its one-line errors, and whole-model runs of every method."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.quant import QuantSpec
from lmforge.quant.apply import quantize_linear
from lmforge.quant.awq import ActStats, ScaleGroup, apply_scales, awq_scales
from lmforge.quant.calib import calibration_tokens
from lmforge.quant.calibrate import CalibOptions, quantize_calibrated
from lmforge.quant.gptq import gptq_quantize, gptq_reference
from lmforge.quant.smoothquant import smooth_scales
from lmforge.utils import LmforgeError


def _correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.rand(k, generator=g) * 3 + 0.2  # uneven channel magnitudes
    return (torch.randn(n, k, generator=g) @ mix) * scale  # (n, K)


@pytest.mark.parametrize(
    "bits,group,symmetric,act_order,extra",
    [
        (4, 16, False, False, {}),
        (4, 16, False, True, {}),
        (4, 32, True, False, {}),
        (8, 64, True, True, {}),
        (4, 16, False, True, {"clip_grid": 20, "clip_weighted": True}),
        (4, 16, True, False, {"clip_grid": 20}),
        (8, 64, True, True, {"fp8": "none"}),
        (8, 64, True, True, {"fp8": "dynamic", "clip_grid": 20, "clip_weighted": True}),
        (8, 64, True, False, {"fp8": "none", "fp8_per_channel": False}),
    ],
)
def test_gptq_equals_the_literal_obs_algorithm(
    bits: int, group: int, symmetric: bool, act_order: bool, extra: dict
) -> None:
    x = _correlated_inputs(256, 64, 0).double()
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = 2 * x.t() @ x / x.shape[0]
    kw = dict(bits=bits, group_size=group, symmetric=symmetric, act_order=act_order, **extra)
    fast = gptq_quantize(w, h, block_size=16, dtype=torch.float64, **kw)  # 4 lazy blocks
    slow = gptq_reference(w, h, **kw)
    assert type(fast) is type(slow)
    assert torch.equal(fast.qweight.view(torch.uint8), slow.qweight.view(torch.uint8))
    torch.testing.assert_close(fast.dequantize(), slow.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layer_error_is_below_rtn(bits: int) -> None:
    x = _correlated_inputs(1024, 128, 2)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    spec = QuantSpec("int4" if bits == 4 else "int8", 32)
    rtn = quantize_linear(w, spec).dequantize()
    gptq = gptq_quantize(w, h, bits=bits, group_size=32).dequantize()
    x_test = _correlated_inputs(512, 128, 2)[:256]  # same distribution
    err_rtn = (x_test @ (rtn - w).t()).norm()
    err_gptq = (x_test @ (gptq - w).t()).norm()
    assert err_gptq < 0.8 * err_rtn


@pytest.mark.parametrize(
    "extra",
    [
        {"clip_grid": 50},
        {"clip_grid": 50, "clip_weighted": True},
    ],
)
def test_gptq_with_clip_search_is_below_rtn_and_deterministic(extra: dict) -> None:
    x = _correlated_inputs(1024, 128, 2)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) ** 3 * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    spec = QuantSpec("int4", 32)
    rtn = quantize_linear(w, spec).dequantize()
    a = gptq_quantize(w, h, group_size=32, **extra)
    b = gptq_quantize(w, h, group_size=32, **extra)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    x_test = _correlated_inputs(512, 128, 2)[:256]

    def err(wq: torch.Tensor) -> float:
        return (x_test @ (wq - w).t()).norm().item()

    assert err(a.dequantize()) < 0.8 * err(rtn)


@pytest.mark.parametrize("activations", ["none", "dynamic"])
def test_gptq_fp8_layer_error_is_below_rtn(activations: str) -> None:
    from lmforge.quant.formats import Fp8Linear

    x = _correlated_inputs(1024, 128, 7)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(8)) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    rtn = Fp8Linear.from_float(w, activations=activations)
    q = gptq_quantize(w, h, fp8=activations, clip_grid=32, clip_weighted=True)
    assert isinstance(q, Fp8Linear) and q.activations == activations
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scales.shape == (64,)
    x_test = _correlated_inputs(512, 128, 7)[:256]
    want = x_test @ w.t()
    assert (q.reference(x_test) - want).norm() < 0.85 * (rtn.reference(x_test) - want).norm()


def test_awq_beats_rtn_with_outlier_channels() -> None:
    g = torch.Generator().manual_seed(4)
    k = 128
    boost = torch.ones(k)
    boost[torch.randperm(k, generator=g)[:4]] = 30.0  # a few channels with large activations
    x = torch.randn(2048, k, generator=g) * boost
    w = torch.randn(96, k, generator=g) * 0.05
    stats = ActStats(max_rows=1024)
    for part in x[:1024].split(128):
        stats.add(part)
    spec = QuantSpec("int4", 32)
    s = awq_scales([w], stats, spec)
    x_test = x[1024:]
    want = x_test @ w.t()
    rtn = x_test @ quantize_linear(w, spec).dequantize().t()
    awq = (x_test / s) @ quantize_linear(w * s, spec).dequantize().t()
    assert (awq - want).norm() < 0.8 * (rtn - want).norm()


def _tiny(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=96, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128
    )
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # outlier channels in the norms' outputs, as trained LMs have
        for layer in model.layers:
            layer.ln1.weight[:3] = 12.0
            layer.ln2.weight[5:7] = 10.0
    return model


@torch.no_grad()
def test_folding_scales_preserves_the_function() -> None:
    model = _tiny()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(ids)
    block = model.layers[0]
    for group in (
        ScaleGroup(["attn.q_proj", "attn.k_proj", "attn.v_proj"], "ln1"),
        ScaleGroup(["ffn.w1", "ffn.w3"], "ln2"),
        ScaleGroup(["ffn.w2"], "ffn.w3"),
    ):
        k = block.get_submodule(group.linears[0]).weight.shape[1]
        s = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5
        assert apply_scales(block, group, s) is None
    torch.testing.assert_close(model(ids), ref, rtol=1e-4, atol=1e-4)


def test_smoothquant_balances_activation_and_weight_ranges() -> None:
    x = torch.randn(512, 32) * (torch.arange(32) + 1.0)
    w = torch.randn(16, 32)
    stats = ActStats()
    stats.add(x)
    s = smooth_scales([w], stats, alpha=0.5)
    x_range = (x / s).abs().amax(0)
    w_range = (w * s).abs().amax(0)
    torch.testing.assert_close(x_range, w_range, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_smoothquant_alpha_search_is_no_worse_on_its_rows() -> None:
    from lmforge.quant.formats import fp8_quantize_rows
    from lmforge.quant.smoothquant import smooth_search

    g = torch.Generator().manual_seed(13)
    boost = torch.ones(64)
    boost[:3] = 40.0  # outlier input channels
    x = torch.randn(1024, 64, generator=g) * boost
    ws = [torch.randn(32, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g) * 0.05]
    stats = ActStats(max_rows=4096, calls=1)
    stats.add(x)
    spec = QuantSpec("fp8")

    def err(s: torch.Tensor) -> float:
        xq, sx = fp8_quantize_rows(x / s)
        xd = xq.float() * sx
        return sum(
            (xd @ quantize_linear(w * s, spec).dequantize().t() - x @ w.t()).pow(2).sum().item()
            for w in ws
        )

    s = smooth_search(ws, stats, spec, grid=10)
    assert s.equal(smooth_search(ws, stats, spec, grid=10))  # deterministic
    assert err(s) <= err(torch.ones(64)) and err(s) <= err(smooth_scales(ws, stats, 0.5))


@torch.no_grad()
def test_shared_input_hessians_equal_their_definition() -> None:
    """q/k/v (and w1/w3) read one tensor, whose product is formed once: every Hessian still
    equals 2 XᵀX / n of that linear's own inputs over every batch."""
    from lmforge.quant.calib import BlockRunner
    from lmforge.quant.calibrate import _hessians

    model = _tiny()
    calib = torch.randint(0, 96, (6, 16), generator=torch.Generator().manual_seed(9))
    runner = BlockRunner(model, calib, batch_size=4)  # two batches
    block = model.layers[0]
    names = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj"]
    names += ["ffn.w1", "ffn.w2", "ffn.w3"]
    xs: dict[str, list[torch.Tensor]] = {}
    runner.inputs_of(block, names, lambda n, x: xs.setdefault(n, []).append(x.clone()))
    hess = _hessians(runner, block, names)
    for n in names:
        x = torch.cat(xs[n])
        torch.testing.assert_close(hess[n], 2 * x.t() @ x / x.shape[0])


@torch.no_grad()
@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("awq", CalibOptions()),
        ("gptq", CalibOptions()),
        (
            "gptq",
            CalibOptions(gptq_clip_grid=20, gptq_clip_weighted=False, gptq_act_order=False),
        ),
    ],
)
def test_calibrated_model_is_closer_than_rtn(method: str, options: CalibOptions) -> None:
    """The whole calibrated model's logits are closer to the float model's than RTN's, and the
    same on a second run."""
    gen = torch.Generator().manual_seed(5)
    calib = torch.randint(0, 96, (16, 32), generator=gen)
    test = torch.randint(0, 96, (4, 32), generator=gen)
    ref = _tiny()(test)
    spec = QuantSpec("int4", 32)
    rtn = quantize_calibrated(_tiny(), spec, "rtn", None)(test)
    a = quantize_calibrated(_tiny(), spec, method, calib, options)(test)
    b = quantize_calibrated(_tiny(), spec, method, calib, options)(test)
    assert torch.equal(a, b)
    assert (a - ref).norm() < (rtn - ref).norm()


@torch.no_grad()
def test_gptq_fp8_whole_model_beats_rtn() -> None:
    gen = torch.Generator().manual_seed(6)
    calib = torch.randint(0, 96, (16, 32), generator=gen)
    test = torch.randint(0, 96, (4, 32), generator=gen)
    ref = _tiny()(test)
    for spec in (QuantSpec("fp8", fp8_activations="none"), QuantSpec("fp8")):
        rtn = quantize_calibrated(_tiny(), spec, "rtn", None)(test)
        model = quantize_calibrated(_tiny(), spec, "gptq", calib)
        assert model.layers[1].ffn.w2.activations == spec.fp8_activations
        assert (model(test) - ref).norm() < (rtn - ref).norm()


@torch.no_grad()
def test_smoothquant_fp8_model_runs_close() -> None:
    gen = torch.Generator().manual_seed(6)
    calib = torch.randint(0, 96, (8, 32), generator=gen)
    test = torch.randint(0, 96, (2, 32), generator=gen)
    ref = _tiny()(test)
    model = quantize_calibrated(_tiny(), QuantSpec("fp8"), "smoothquant", calib)
    assert model.layers[0].attn.output_proj.input_scale is not None  # not foldable: kept
    assert model.layers[0].attn.q_proj.input_scale is None  # folded into ln1
    rtn = quantize_calibrated(_tiny(), QuantSpec("fp8"), "rtn", None)
    # fp8's exponent already absorbs most outliers: migration must not cost accuracy
    assert (model(test) - ref).norm() < 1.1 * (rtn(test) - ref).norm()


def test_method_errors_are_one_line() -> None:
    with pytest.raises(LmforgeError, match="unknown quantization method"):
        quantize_calibrated(_tiny(), QuantSpec("int4", 32), "hqq", None)
    with pytest.raises(LmforgeError, match="needs calibration text"):
        quantize_calibrated(_tiny(), QuantSpec("int4", 32), "gptq", None)
    with pytest.raises(LmforgeError, match="smoothquant prepares W8A8"):
        quantize_calibrated(_tiny(), QuantSpec("int4", 32), "smoothquant", None)


class _Chars:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 96 for c in text]


def test_calibration_tokens(tmp_path: Path) -> None:
    f = tmp_path / "calib.txt"
    f.write_text("abcdefghij" * 20, encoding="utf-8")
    toks = calibration_tokens(f, _Chars(), n_samples=4, seq_len=50)
    assert toks.shape == (4, 50) and toks.dtype == torch.long
    assert toks[0, 0].item() == ord("a") % 96  # windows start at the file's start ...
    assert toks[-1, -1].item() == ord("j") % 96  # ... and end at its end
    with pytest.raises(LmforgeError, match="calibration file not found"):
        calibration_tokens(tmp_path / "missing.txt", _Chars(), 4, 50)
    with pytest.raises(LmforgeError, match="has 200 tokens; 8 samples × 50 tokens need 400"):
        calibration_tokens(f, _Chars(), 8, 50)
