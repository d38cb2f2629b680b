"""Every RMSNorm launch variant (tile/loop forward, slab/loop backward, prefetch, pipelining,
evict hints, both dw reductions) against float64, on CPU through Triton's interpreter.

As in ``test_kernels_interp.py``, ``TRITON_INTERPRET=1`` must be set before Triton is imported,
so the default-tier test re-runs this file in a subprocess with it set. Shapes are ragged on
purpose: 37 rows is not a multiple of any ROWS, 1000 columns not a power of two, and 5 rows is
fewer than one tile. The config objects, the defaults table and the sweep script's argument
handling are checked in-process; the slow tier compiles each variant for sm_90 (no GPU needed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from _interp import run_pytest_in_interpreter

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")


def _sweep_module():
    spec = importlib.util.spec_from_file_location(
        "rmsnorm_sweep", _ROOT / "benchmarks" / "rmsnorm_sweep.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


if not _CHILD:

    def test_rms_norm_variants_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__)

    def test_configs_validate_and_defaults_cover_the_table() -> None:
        from lmforge.kernels import _rms_norm_triton as rn

        for block, cfg in [*rn.FWD_CONFIGS.items(), *rn.BWD_CONFIGS.items()]:
            assert block & (block - 1) == 0, block
            assert cfg.validate() is cfg
            assert eval(rn.config_repr(cfg), vars(rn)) == cfg  # the printed form pastes back
        for d in (1, 48, 768, 1000, 2048, 3000, 8192, 16384):
            fwd, bwd = rn.default_config(d), rn.default_config(d, backward=True)
            assert isinstance(fwd, rn.FwdConfig) and isinstance(bwd, rn.BwdConfig)
            fwd.validate()
            bwd.validate()
        assert rn.default_config(768) == rn.FWD_CONFIGS[1024]
        # _tile stays the fallback and the sm_90 compile test's source of tiles.
        assert rn._tile(768) == (1024, 4, 8) and rn._tile(8192, backward=True) == (8192, 1, 16)

    @pytest.mark.parametrize(
        "cfg, match",
        [
            ("FwdConfig(rows=4, warps=4, prefetch=True)", "programs_per_sm > 0"),
            (
                "FwdConfig(rows=4, warps=4, programs_per_sm=2, prefetch=True, stages=2)",
                "alternatives",
            ),
            ("FwdConfig(rows=3, warps=4)", "power of two"),
            ("FwdConfig(rows=4, warps=32)", "power of two"),
            ("BwdConfig(rows=4, warps=4, evict=True)", "loop=True"),
            ("BwdConfig(rows=4, warps=4, programs_per_sm=0)", "programs_per_sm >= 1"),
            ("BwdConfig(rows=4, warps=4, dw_reduce='atomic')", "dw_reduce"),
        ],
    )
    def test_invalid_configs_are_refused(cfg: str, match: str) -> None:
        from lmforge.kernels import _rms_norm_triton as rn

        with pytest.raises(ValueError, match=match):
            eval(cfg, vars(rn)).validate()

    def test_sweep_help_and_candidate_lists_need_no_gpu(capsys) -> None:
        sweep = _sweep_module()
        with pytest.raises(SystemExit) as done:
            sweep.main(["--help"])
        assert done.value.code == 0 and "--device cpu" in capsys.readouterr().out
        assert sweep.main(["--list", "--shapes", "32768x768,16384x8192"]) == 0
        listed = capsys.readouterr().out
        assert "D=768 fwd" in listed and "D=8192 bwd" in listed
        for d in (768, 2048, 4096, 8192):  # the lead's ~3-minute run: 20–40 per direction
            fwd, bwd = sweep.fwd_candidates(d), sweep.bwd_candidates(d)
            assert 10 <= len(fwd) <= 40 and 10 <= len(bwd) <= 40, (d, len(fwd), len(bwd))
            for cfg in fwd + bwd + [n for c in fwd + bwd for n in sweep.neighbours(c)]:
                if cfg.programs_per_sm <= 16:
                    cfg.validate()
        with pytest.raises(SystemExit, match="not NxD"):
            sweep.main(["--shapes", "32768by768", "--list"])

    @pytest.mark.slow
    def test_rms_norm_variants_compile_for_sm90() -> None:
        # Each kernel × option through Triton's full pipeline to a Hopper cubin (bundled ptxas):
        # catches type errors and resource overflows without a GPU; the loads stay 16-byte.
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from lmforge.kernels import _rms_norm_triton as rn

        def build(kernel, constexprs: dict, warps: int):
            ptrs = {"RSTD": "*fp32", "DWP": "*fp32"}
            pointers = {"X", "W", "Y", "DY", "DX", "DW", "RSTD", "DWP"}
            signature, attrs = {}, {}
            for i, name in enumerate(kernel.arg_names):
                if name in constexprs:
                    signature[name] = "constexpr"
                elif name in pointers:
                    signature[name] = ptrs.get(name, "*bf16")
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif name == "eps":
                    signature[name] = "fp32"
                else:
                    signature[name] = "i32"
                    if name.startswith("stride") or name == "D":
                        attrs[(i,)] = [["tt.divisibility", 16]]
            src = ASTSource(kernel, signature, constexprs, attrs)
            return triton.compile(
                src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
            )

        for block in (1024, 4096):
            for kernel in (rn._rms_fwd_loop, rn._rms_bwd_loop):
                for prefetch, stages, policy in (
                    (True, 1, ""),
                    (False, 2, ""),
                    (True, 1, rn._STREAM),
                ):
                    consts = {"BLOCK_D": block, "ROWS": 4096 // block, "PREFETCH": prefetch,
                              "STAGES": stages, "POLICY": policy}  # fmt: skip
                    compiled = build(kernel, consts, 8)
                    ptx = compiled.asm["ptx"]
                    assert compiled.metadata.shared <= 232448
                    assert "cp.async" in ptx if stages > 1 else ".v4.b32" in ptx
        compiled = build(rn._dw_sum, {"BLOCK_P": 128, "BLOCK_C": 16}, 4)
        assert "ld.global" in compiled.asm["ptx"]

else:
    from lmforge.kernels import _rms_norm_triton as rn
    from lmforge.kernels import rms_norm_reference

    TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}
    F, B = rn.FwdConfig, rn.BwdConfig
    FWD = [
        None,  # the default for the width
        F(rows=4, warps=4),
        F(rows=1, warps=4),
        F(rows=8, warps=4, programs_per_sm=2, prefetch=True),
        F(rows=4, warps=4, programs_per_sm=3, stages=2, evict=True),
        F(rows=16, warps=8, programs_per_sm=1, prefetch=True, evict=True),
    ]
    BWD = [
        None,
        B(rows=4, warps=4, programs_per_sm=2),
        B(rows=8, warps=4, programs_per_sm=1, dw_reduce="triton"),
        B(rows=4, warps=4, programs_per_sm=3, loop=True, prefetch=True),
        B(rows=8, warps=8, programs_per_sm=2, loop=True, stages=2, evict=True, dw_reduce="triton"),
        B(rows=1, warps=4, programs_per_sm=4, loop=True, prefetch=True, evict=True),
    ]
    SHAPES = [(37, 1000), (5, 48)]

    def _inputs(n: int, d: int, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(n + d)
        x = (torch.randn(n, d, generator=gen) * 3).to(dtype)
        w = (torch.rand(d, generator=gen) + 0.5).to(dtype)
        dy = torch.randn(n, d, generator=gen).to(dtype)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        y = rms_norm_reference(xr, wr, 1e-5)
        dx, dw = torch.autograd.grad(y, (xr, wr), dy.double())
        rstd = xr.detach().pow(2).mean(-1).add(1e-5).rsqrt()
        return x, w, dy, (y.detach(), rstd, dx, dw)

    def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        # Relative to the output's largest magnitude (dw sums over all rows).
        scale = max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item() / scale
        assert err <= TOL[dtype], f"{what}: max error {err:.3g} × scale {scale:.3g}"

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(
        "cfg", FWD, ids=lambda c: "default" if c is None else rn.config_repr(c)
    )
    def test_forward_variant(cfg, dtype, shape) -> None:
        x, w, _, (y_ref, rstd_ref, _, _) = _inputs(*shape, dtype)
        y, rstd = rn.forward(x, w, 1e-5, config=cfg)
        assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32
        _close(y, y_ref, dtype, "y")
        _close(rstd, rstd_ref, torch.float32, "rstd")

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(
        "cfg", BWD, ids=lambda c: "default" if c is None else rn.config_repr(c)
    )
    def test_backward_variant(cfg, dtype, shape) -> None:
        x, w, dy, (_, _, dx_ref, dw_ref) = _inputs(*shape, dtype)
        _, rstd = rn.forward(x, w, 1e-5)
        dx, dw = rn.backward(x, w, rstd, dy, config=cfg)
        assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == w.shape
        _close(dx, dx_ref, dtype, "dx")
        _close(dw, dw_ref, dtype, "dw")

    def test_dw_is_deterministic_and_empty_input_is_fine() -> None:
        x, w, dy, _ = _inputs(37, 1000, torch.float32)
        _, rstd = rn.forward(x, w, 1e-5)
        for cfg in BWD[1:]:
            first = rn.backward(x, w, rstd, dy, config=cfg)[1]
            assert torch.equal(first, rn.backward(x, w, rstd, dy, config=cfg)[1])
        empty = x[:0]
        y, r = rn.forward(empty, w, 1e-5, config=FWD[3])
        assert y.shape == (0, 1000) and r.shape == (0,)
        dx, dw = rn.backward(empty, w, r, empty, config=BWD[3])
        assert dx.shape == (0, 1000) and torch.equal(dw, torch.zeros_like(w))

    def test_sweep_runs_on_the_interpreter(capsys) -> None:
        sweep = _sweep_module()
        argv = ["--device", "cpu", "--shapes", "19x200", "--quick", "--reps", "1", "--warmup", "0"]
        assert sweep.main(argv) == 0
        out = capsys.readouterr().out
        assert "FWD_CONFIGS: dict[int, FwdConfig] = {" in out and "    256: BwdConfig(" in out
        assert "WRONG" not in out
