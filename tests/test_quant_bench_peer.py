"""benchmarks/quant.py's int4 peer: torch's tinygemm (``aten._weight_int4pack_mm``) on our codes.

The conversion (tinygemm dequantizes (q − 8)·s + z) is checked on the CPU op against a float64
product with the module's dequantized weights; the CUDA op's packing is checked by the
benchmark itself before it times anything.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmforge.quant.formats import Int4Linear

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_quant", REPO / "benchmarks" / "quant.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("symmetric", [False, True])
def test_tinygemm_peer_computes_the_modules_product(symmetric: bool) -> None:
    bench = _bench()
    torch.manual_seed(0)
    mod = Int4Linear.from_float(torch.randn(256, 512) * 0.02 + 0.003, 128, symmetric)
    x = torch.randn(3, 512)
    want = x.double() @ mod.dequantize().double().t()  # (3, 256)
    op, packed, sz = bench.tinygemm_pack(mod)
    got = op(x.to(torch.bfloat16), packed, 128, sz).double()
    # bf16 activations and bf16 scale/zero: ~3 significant digits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    bench.tinygemm_forward(mod)
    y = mod(x.view(1, 3, 512))  # the module now runs tinygemm, shapes and dtype kept
    assert y.shape == (1, 3, 256) and y.dtype == torch.float32
    assert torch.allclose(y.view(3, 256).double(), got, atol=1e-6)
