"""Quantized weight formats: pack/unpack round trips, dequantization error bounds, each module's
forward against its dequantize-then-matmul reference, dtype-keeping moves, quantize_model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.model import ModelConfig, TransformerLM
from lmforge.quant import Fp8Linear, Int4Linear, Int8Linear, QuantSpec, quantize_model
from lmforge.quant.formats import (
    fp8_quantize_rows,
    int4_codes,
    int4_params,
    pack_int4,
    unpack_int4,
)
from lmforge.utils import LmforgeError


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 4),
    group=st.sampled_from([2, 8, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_int4_pack_unpack_round_trip(rows: int, groups: int, group: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, groups * group), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes, group)
    assert packed.shape == (rows, groups * group // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, group), codes)


def test_int4_layout_is_half_split_per_group() -> None:
    # byte i of a group: low nibble = column i, high nibble = column G/2 + i (GGUF's Q4 layout)
    codes = torch.arange(16, dtype=torch.uint8).repeat(1, 2)  # (1, 32): 0..15, 0..15
    packed = pack_int4(codes, 32)
    assert packed[0, 0].item() == 0 | (0 << 4) and packed[0, 1].item() == 1 | (1 << 4)
    codes = torch.cat([torch.zeros(1, 16), torch.full((1, 16), 15)], 1).to(torch.uint8)
    assert torch.all(pack_int4(codes, 32) == 0xF0)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(symmetric: bool, group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 256)
    m = Int4Linear.from_float(w, group, symmetric)
    s = m.scales.float().repeat_interleave(group, 1)  # (N, K)
    err = (m.dequantize() - w).abs()
    # half a step, plus the fp16 rounding of the stored offset (asymmetric)
    slack = 0 if symmetric else m.offsets.float().abs().repeat_interleave(group, 1) * 2**-10
    assert torch.all(err <= s / 2 + slack + 1e-6)
    assert (m.offsets is None) == symmetric
    assert m.qweight.numel() == w.numel() // 2


def test_int4_reference_formula() -> None:
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    s, off = int4_params(w, 32, symmetric=False)
    q = int4_codes(w, s, off, 32).float()  # (8, 64)
    want = q * s.float().repeat_interleave(32, 1) + off.float().repeat_interleave(32, 1)
    m = Int4Linear.from_float(w, 32)
    torch.testing.assert_close(m.dequantize(), want, rtol=0, atol=0)
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(m(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    sym = Int4Linear.from_float(w, 32, symmetric=True)
    qs = sym.codes().float()
    want_s = (qs - 8) * sym.scales.float().repeat_interleave(32, 1)
    torch.testing.assert_close(sym.dequantize(), want_s, rtol=0, atol=0)


@pytest.mark.parametrize("group", [None, 32])
def test_int8_error_and_forward(group: int | None) -> None:
    torch.manual_seed(2)
    w = torch.randn(16, 96)
    m = Int8Linear.from_float(w, group)
    g = 96 if group is None else group
    assert m.scales.shape == (16, 96 // g)
    s = m.scales.float().repeat_interleave(g, 1)
    assert torch.all((m.dequantize() - w).abs() <= s / 2 + 1e-6)
    assert m.qweight.abs().max() <= 127
    x = torch.randn(4, 96)
    torch.testing.assert_close(m(x), x @ m.dequantize().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_weight_only_and_w8a8_reference(per_channel: bool) -> None:
    torch.manual_seed(3)
    w = torch.randn(32, 64)
    m = Fp8Linear.from_float(w, per_channel, activations="none")
    assert m.qweight.dtype == torch.float8_e4m3fn
    assert m.scales.shape == ((32,) if per_channel else (1,))
    # e4m3 has 3 mantissa bits: relative error ≤ 2^-4 (normal range)
    rel = ((m.dequantize() - w).abs() / w.abs().clamp_min(1e-2)).max()
    assert rel <= 2**-4 + 1e-6
    x = torch.randn(5, 64)
    torch.testing.assert_close(m(x), x @ m.dequantize().t(), rtol=1e-5, atol=1e-5)
    a = Fp8Linear.from_float(w, per_channel, activations="dynamic")
    xq, sx = fp8_quantize_rows(x)
    assert sx.shape == (5, 1) and xq.float().abs().max() <= 448
    want = (xq.float() * sx) @ a.dequantize().t()
    torch.testing.assert_close(a(x), want, rtol=1e-5, atol=1e-5)
    assert (a(x) - x @ w.t()).abs().max() < 0.15 * (x @ w.t()).abs().max()


def test_input_scale_is_divided_out() -> None:
    torch.manual_seed(4)
    w = torch.randn(8, 64)
    scale = torch.rand(64) + 0.5
    m = Int8Linear.from_float(w * scale)  # W' = W·diag(s), x' = x / s: same product
    m.set_input_scale(scale)
    x = torch.randn(3, 64)
    torch.testing.assert_close(m(x), (x / scale) @ m.dequantize().t(), rtol=1e-5, atol=1e-5)
    exact = x @ w.t()
    assert (m(x) - exact).norm() < 0.02 * exact.norm()


def test_buffers_keep_their_dtypes_under_model_to() -> None:
    w = torch.randn(16, 64)
    mods = [Int8Linear.from_float(w), Int4Linear.from_float(w, 32), Fp8Linear.from_float(w)]
    for m in mods:
        before = {k: v.dtype for k, v in m.named_buffers()}
        m.to(torch.bfloat16)
        assert {k: v.dtype for k, v in m.named_buffers()} == before
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        assert m(x).dtype == torch.bfloat16


def _tiny() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize(
    "spec",
    [QuantSpec("int8", None), QuantSpec("int4", 32), QuantSpec("fp8", fp8_activations="none")],
)
def test_quantize_model_swaps_linears_in_place(spec: QuantSpec) -> None:
    model = _tiny()
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ref = model(ids)
        quantize_model(model, spec)
        got = model(ids)
    kinds = {type(m).__name__ for m in model.modules()}
    assert type(model.lm_head).__name__ == "Linear"  # skipped by default
    assert {"Int8Linear", "Int4Linear", "Fp8Linear"} & kinds
    assert not any(type(m).__name__ == "Linear" for m in model.layers.modules())
    rel = (got - ref).norm() / ref.norm()
    assert rel < {"int4": 0.15, "int8": 0.01, "fp8": 0.06}[spec.format]


def _stack_cases() -> list[list]:
    g = torch.Generator().manual_seed(3)

    def w(n: int) -> torch.Tensor:
        return torch.randn(n, 64, generator=g) * 0.1

    return [
        [Int4Linear.from_float(w(n), 32) for n in (48, 16, 16)],
        [Int4Linear.from_float(w(n), 16, symmetric=True) for n in (40, 40)],
        [Int8Linear.from_float(w(n), 32) for n in (24, 8, 8)],
        [Fp8Linear.from_float(w(n), per_channel=True, activations="none") for n in (32, 32)],
    ]


@pytest.mark.parametrize("case", range(4))
def test_stacked_rows_compute_the_concatenated_outputs_on_shared_buffers(case: int) -> None:
    # the engine's one GEMV for q/k/v or w1/w3: outputs equal the modules' own, concatenated;
    # each module's buffers become row views of the stack (the weights are held once)
    mods = _stack_cases()[case]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    mods[0].set_input_scale(torch.rand(64) + 0.5)
    for m in mods[1:]:
        m.set_input_scale(mods[0].input_scale.clone())
    want = torch.cat([m.reference(x) for m in mods], dim=-1)
    before = [m.dequantize() for m in mods]
    stacked = type(mods[0]).stack_rows(mods)
    assert stacked is not None and type(stacked) is type(mods[0])
    assert stacked.d_out == sum(m.d_out for m in mods) and stacked.d_in == 64
    torch.testing.assert_close(stacked.reference(x), want)
    for m, b in zip(mods, before, strict=True):
        torch.testing.assert_close(m.dequantize(), b)  # unchanged values, now views
        assert (
            m.qweight.untyped_storage().data_ptr() == stacked.qweight.untyped_storage().data_ptr()
        )
        assert m.scales.untyped_storage().data_ptr() == stacked.scales.untyped_storage().data_ptr()


def test_modules_that_do_not_stack_give_none() -> None:
    w = torch.randn(32, 64) * 0.1
    a = Int4Linear.from_float(w, 32)
    assert Int4Linear.stack_rows([a, Int4Linear.from_float(w, 16)]) is None  # group
    assert Int4Linear.stack_rows([a, Int4Linear.from_float(w, 32, symmetric=True)]) is None
    assert Int4Linear.stack_rows([a, Int8Linear.from_float(w, 32)]) is None  # format
    assert Int4Linear.stack_rows([a, Int4Linear.from_float(torch.randn(32, 128), 32)]) is None
    b = Int4Linear.from_float(w, 32)
    b.set_input_scale(torch.rand(64) + 0.5)
    assert Int4Linear.stack_rows([a, b]) is None  # one scaled input, one not
    per_tensor = [Fp8Linear.from_float(w, per_channel=False) for _ in range(2)]
    assert Fp8Linear.stack_rows(per_tensor) is None  # a scale per module, not per row
    assert a.qweight.untyped_storage().data_ptr() != b.qweight.untyped_storage().data_ptr()


def test_group_not_dividing_the_width_is_one_line() -> None:
    model = _tiny()
    with pytest.raises(LmforgeError, match="group size 48 does not divide the width 64"):
        quantize_model(model, QuantSpec("int4", 48))
    with pytest.raises(LmforgeError, match="unknown quantization format"):
        QuantSpec("int3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_gpu_fast_paths_match_their_references(rows: int) -> None:
    torch.manual_seed(7)
    w = torch.randn(384, 512, device="cuda") * 0.05
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    mods = [Int4Linear.from_float(w, 128), Int4Linear.from_float(w, 64, symmetric=True)]
    mods += [Int8Linear.from_float(w), Int8Linear.from_float(w, 32)]
    if torch.cuda.get_device_capability() >= (8, 9):
        mods.append(Fp8Linear.from_float(w))
    for m in mods:
        with torch.no_grad():
            got = m(x).float()
            want = m.reference(x.float()).float()  # fp32 reference of the same rounding
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-2, (type(m).__name__, rel)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_int4_clip_search_never_increases_the_error(symmetric: bool, weighted: bool) -> None:
    from lmforge.quant.formats import _int4_err, int4_params_search

    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 128, generator=g) ** 3  # heavy tails: clipping pays off
    c = torch.rand(128, generator=g) * 4 + 0.1 if weighted else None
    s0, m0 = int4_params(w, 32, symmetric)
    s1, m1 = int4_params_search(w, 32, symmetric, grid=50, col_weight=c)
    assert s1.dtype == torch.float16 and s1.shape == (48, 4)
    assert (m1 is None) == symmetric
    wg = w.reshape(48, 4, 32)
    cg = (torch.ones(128) if c is None else c).reshape(1, 4, 32)
    e0 = _int4_err(wg, s0, m0, cg, 2.4)  # (N, K/G)
    e1 = _int4_err(wg, s1, m1, cg, 2.4)
    assert (e1 <= e0).all()
    assert e1.sum() < 0.97 * e0.sum()
    # the codes under the searched parameters dequantize to the searched error
    m = Int4Linear.from_codes(int4_codes(w, s1, m1, 32), s1, m1, 32)
    e = ((m.dequantize() - w).abs().pow(2.4).reshape(48, 4, 32) * cg).sum(-1)
    torch.testing.assert_close(e, e1)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_fp8_scale_search_never_increases_the_error(per_channel: bool, weighted: bool) -> None:
    from lmforge.quant.formats import fp8_scales

    g = torch.Generator().manual_seed(12)
    w = torch.randn(40, 96, generator=g) * (torch.rand(40, 1, generator=g) + 0.1)
    c = torch.rand(96, generator=g) + 0.05 if weighted else torch.ones(96)

    def err(s: torch.Tensor) -> torch.Tensor:
        m = Fp8Linear.from_float(w, per_channel, "none", scales=s)
        e = ((m.dequantize() - w).pow(2) * c).sum(-1)
        return e if per_channel else e.sum()

    s0 = fp8_scales(w, per_channel)
    torch.testing.assert_close(s0, Fp8Linear.from_float(w, per_channel).scales)  # absmax / 448
    s1 = fp8_scales(w, per_channel, grid=32, col_weight=c if weighted else None)
    assert s1.shape == s0.shape and (s1 >= s0).all()  # never clips: scales only grow
    assert (err(s1) <= err(s0)).all() and err(s1).sum() < 0.99 * err(s0).sum()
    assert fp8_scales(w, per_channel, grid=32).equal(fp8_scales(w, per_channel, grid=32))
