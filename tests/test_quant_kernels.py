"""The dequant-fused Triton GEMV/GEMM (int4, int8) against float64 references, on CPU through
Triton's interpreter (the default-tier test re-runs this file in a subprocess with
TRITON_INTERPRET=1), and the custom ops under torch.compile. Shapes are tiny and N is not a
multiple of the tiles; inputs are random and non-zero."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None

if not _CHILD:

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_quant_kernels_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__, timeout=580)

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("fmt", ["int4", "fp8"])
    def test_row_kernels_lower_for_sm90_without_shared_memory_in_their_loop(fmt: str) -> None:
        # the batch-1 CUDA-core GEMVs as Hopper runs them, lowered on the CPU: 16-byte loads of
        # the codes, no tensor-core op, one barrier (the final reduction), at most 64 registers (72 allowed)
        import re

        from _sm90 import compile_sm90, ptxas_registers
        from lmforge.quant._gemv_triton import _fp8_gemv_row_kernel, _int4_gemv_row_kernel

        def arg(name: str) -> tuple[str, bool]:
            fp8 = fmt == "fp8"  # W8A8: x as e4m3 codes, fp32 scales
            types = {"q_ptr": "*fp8e4nv" if fp8 else "*u8",
                     "s_ptr": "*fp32" if fp8 else "*fp16", "xs_ptr": "*fp32", "o_ptr": "*fp16",
                     "out_ptr": "*fp32", "x_ptr": "*fp8e4nv" if fp8 else "*bf16"}  # fmt: skip
            return types.get(name, "i32"), name != "N"

        if fmt == "int4":
            jit, consts = _int4_gemv_row_kernel, dict(G=128, SYMMETRIC=False, SUB=1, BLOCK_N=32)
        else:  # W8A8, per-channel scales (the row's after the sum), 64-wide chunks
            jit = _fp8_gemv_row_kernel
            consts = dict(PER_ROW=True, X_SCALE=True, BLOCK_K=64, SUB=1, BLOCK_N=32)
        ptx = compile_sm90(jit, consts, arg, warps=4).asm["ptx"]
        assert "wgmma" not in ptx and "mma.sync" not in ptx
        assert re.search(r"ld\.global(\.nc)?\.v4", ptx)
        assert len(re.findall(r"bar\.sync", ptx)) <= 2
        regs, spills = ptxas_registers(ptx)
        assert spills == 0 and regs <= 72, regs

else:
    from lmforge.quant import Int4Linear, Int8Linear
    from lmforge.quant._gemm_triton import gemm_reference, int4_gemm, int8_gemm
    from lmforge.quant._gemv_triton import gemv_reference, int4_gemv_partials, int8_gemv_partials

    def _x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(m * 7 + k)
        x = torch.randn(m, k, generator=g) + 0.1  # shifted: offsets times Σx matter
        return x.to(dtype)

    def _w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.1

    def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        scale = want.abs().max().item()
        err = (got.double() - want).abs().max().item()
        assert err <= tol * scale, f"max error {err} vs scale {scale}"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("symmetric", [False, True])
    @pytest.mark.parametrize("m,group", [(1, 32), (3, 64), (8, 128)])
    def test_int4_gemv(m: int, group: int, symmetric: bool, dtype: torch.dtype) -> None:
        n, k = 72, 256
        mod = Int4Linear.from_float(_w(n, k), group, symmetric)
        x = _x(m, k, dtype)
        got = int4_gemv_partials(x, mod.qweight, mod.scales, mod.offsets, group).sum(0)
        _check(got, gemv_reference(x, mod.dequantize()), dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("m,group", [(1, None), (5, 32), (8, 64)])
    def test_int8_gemv(m: int, group: int | None, dtype: torch.dtype) -> None:
        n, k = 72, 192
        mod = Int8Linear.from_float(_w(n, k), group)
        x = _x(m, k, dtype)
        got = int8_gemv_partials(x, mod.qweight, mod.scales, mod.group_size).sum(0)
        _check(got, gemv_reference(x, mod.dequantize()), dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("symmetric", [False, True])
    def test_int4_gemm(symmetric: bool, dtype: torch.dtype) -> None:
        m, n, k, group = 70, 136, 128, 32
        mod = Int4Linear.from_float(_w(n, k), group, symmetric)
        x = _x(m, k, dtype)
        got = int4_gemm(x, mod.qweight, mod.scales, mod.offsets, group)
        assert got.dtype == dtype
        _check(got, gemm_reference(x, mod.dequantize()), dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_int8_gemm(dtype: torch.dtype) -> None:
        m, n, k = 20, 72, 96
        mod = Int8Linear.from_float(_w(n, k), 32)
        x = _x(m, k, dtype)
        got = int8_gemm(x, mod.qweight, mod.scales, mod.group_size)
        _check(got, gemm_reference(x, mod.dequantize()), dtype)

    def test_modules_take_the_kernels_and_match_their_reference() -> None:
        from lmforge.quant.ops import quant_matmul_supported

        w = _w(40, 128)
        for mod in (Int4Linear.from_float(w, 64), Int8Linear.from_float(w)):
            for rows in (2, 12):
                x = _x(rows, 128, torch.float32)
                assert quant_matmul_supported(x, mod)
                with torch.no_grad():
                    _check(mod(x), gemv_reference(x, mod.dequantize()), torch.float32)
                    torch.testing.assert_close(mod(x), mod.reference(x), rtol=1e-4, atol=1e-4)

    def test_custom_ops_compile_without_graph_breaks() -> None:
        # the fake implementations give Dynamo the output shapes; fullgraph fails on any break
        mod = Int4Linear.from_float(_w(40, 128), 32)
        x = _x(3, 128, torch.float32)

        def f(inp: torch.Tensor) -> torch.Tensor:
            return (
                torch.ops.lmforge_quant.int4_matmul(inp, mod.qweight, mod.scales, mod.offsets, 32)
                * 2
            )

        compiled = torch.compile(f, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), f(x))

    @pytest.mark.parametrize("fmt", ["int4", "int4-sym", "int8"])
    def test_every_gemv_launch_config_computes_the_product(fmt: str) -> None:
        # the sweep's launches (groups or chunks an iteration, split, rows a program) all give
        # x Wᵀ: uneven splits of the chunks, a chunk of every group, 32- and 128-row tiles, and
        # every launch of the tuned TABLE (which quant_gemv_config hands its shape)
        from lmforge.quant._gemv_triton import TABLE, QuantGemvConfig, quant_gemv_config

        for (f, n, k, g), c in TABLE.items():
            assert quant_gemv_config(f, n, k, g, torch.device("cpu")) is c

        w, x = _w(72, 512), _x(3, 512, torch.float32)
        if fmt == "int8":
            mod = Int8Linear.from_float(w, 64)
        else:
            mod = Int4Linear.from_float(w, 64, symmetric=fmt == "int4-sym")
        want = gemv_reference(x, mod.dequantize())
        tuned = {c for (f, *_), c in TABLE.items() if f == fmt.removesuffix("-sym")}
        for cfg in (QuantGemvConfig(1), QuantGemvConfig(3, sub=2), QuantGemvConfig(2, sub=4,
                    block_n=32), QuantGemvConfig(1, sub=8, block_n=128), *tuned):  # fmt: skip
            if fmt == "int8":
                parts = int8_gemv_partials(x, mod.qweight, mod.scales, 64, config=cfg)
            else:
                parts = int4_gemv_partials(x, mod.qweight, mod.scales, mod.offsets, 64, config=cfg)
            assert parts.shape == (cfg.split, 3, 72)
            _check(parts.sum(0), want, torch.float32)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int4-sym", 64)])
    def test_row_kernel_launches_compute_the_product(fmt: str, group: int,
                                                     dtype: torch.dtype) -> None:  # fmt: skip
        # batch 1 on the CUDA-core kernel (codes unpacked in registers): every tile, chunk and
        # uneven split gives x Wᵀ; the same config at 3 rows keeps the dot kernel, same split
        from lmforge.quant._gemv_triton import QuantGemvConfig

        mod = Int4Linear.from_float(_w(72, 512), group, symmetric=fmt == "int4-sym")
        chunks = 512 // group
        for rows in (1, 3):
            x = _x(rows, 512, dtype)
            want = gemv_reference(x, mod.dequantize())
            for cfg in (QuantGemvConfig(1, rows_kernel=True, block_n=16),
                        QuantGemvConfig(3, sub=1, block_n=32, rows_kernel=True),
                        QuantGemvConfig(2, sub=2, block_n=64, warps=8, rows_kernel=True),
                        QuantGemvConfig(1, sub=4, rows_kernel=True)):  # fmt: skip
                if chunks % cfg.sub:
                    continue
                parts = int4_gemv_partials(x, mod.qweight, mod.scales, mod.offsets, group,
                                           config=cfg)  # fmt: skip
                assert parts.shape == (cfg.split, rows, 72)
                _check(parts.sum(0), want, dtype)

    @pytest.mark.parametrize("per_channel", [True, False])
    @pytest.mark.parametrize("activations", ["dynamic", "none"])
    def test_fp8_row_kernel_computes_the_reference_product(per_channel: bool,
                                                           activations: str) -> None:  # fmt: skip
        # batch 1 of an e4m3 weight: weight-only (x as is) or W8A8 (x rounded to e4m3 per row,
        # both scales after the fp32 sum), against float64 on the same codes; every launch
        from lmforge.quant import Fp8Linear
        from lmforge.quant._gemv_triton import QuantGemvConfig, fp8_gemv_partials
        from lmforge.quant.formats import fp8_quantize_rows

        mod = Fp8Linear.from_float(_w(72, 512), per_channel, activations)
        x = _x(1, 512, torch.float32)
        xq, sx = fp8_quantize_rows(x)  # (1, K), (1, 1)
        if activations == "dynamic":
            want = (xq.double() * sx.double()) @ mod.dequantize().double().t()
            args = (xq, mod.qweight, mod.scales, sx.reshape(1))
        else:
            want = x.double() @ mod.dequantize().double().t()
            args = (x, mod.qweight, mod.scales, None)
        for cfg in (QuantGemvConfig(1, block_n=16, rows_kernel=True),
                    QuantGemvConfig(3, sub=2, block_n=32, rows_kernel=True),
                    QuantGemvConfig(2, sub=4, block_n=64, warps=8, rows_kernel=True)):  # fmt: skip
            parts = fp8_gemv_partials(*args, config=cfg)
            assert parts.shape == (cfg.split, 1, 72)
            _check(parts.sum(0), want, torch.float32)

    def test_fp8_decode_gemv_only_for_swept_shapes_at_batch_1(monkeypatch) -> None:
        # an fp8 module takes the GEMV only where the sweep put its shape in the TABLE, and
        # only for one row; its partials add up to the module's own product
        from lmforge.quant import Fp8Linear
        from lmforge.quant import _gemv_triton as gt

        mod = Fp8Linear.from_float(_w(72, 512))
        x = _x(1, 512, torch.float32)
        assert mod.decode_partials(x) is None  # no TABLE entry: _scaled_mm stays
        monkeypatch.setitem(
            gt.TABLE, ("fp8", 72, 512, 512), gt.QuantGemvConfig(2, rows_kernel=True)
        )
        parts = mod.decode_partials(x)
        assert parts is not None and parts.shape == (2, 1, 72)
        _check(parts.sum(0), mod.reference(x).double(), torch.float32)
        assert mod.decode_partials(_x(2, 512, torch.float32)) is None  # batch 2: _scaled_mm

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_decode_gemv_partials_add_up_to_the_module(dtype: torch.dtype) -> None:
        # the engine's decode path: partial sums out of the op, added and cast in torch; the
        # fake implementation's split matches the kernel's (fullgraph through the op)
        def decode_gemv(mod, x):
            return mod.decode_gemv(x)

        w = _w(72, 256)
        x = _x(3, 256, dtype)
        for mod in (Int4Linear.from_float(w, 64), Int4Linear.from_float(w, 32, True),
                    Int8Linear.from_float(w, 64)):  # fmt: skip
            with torch.no_grad():
                got = decode_gemv(mod, x)
                assert got is not None and got.dtype == dtype and got.shape == (3, 72)
                _check(got, gemv_reference(x, mod.dequantize()), dtype)
                compiled = torch.compile(lambda t, m=mod: decode_gemv(m, t), fullgraph=True,
                                         backend="aot_eager")  # fmt: skip
                torch.testing.assert_close(compiled(x), got)
        assert decode_gemv(Int4Linear.from_float(w, 64), _x(9, 256, dtype)) is None  # > 8 rows

    def _serve_recording_graphs(spec, seed: int, prompts: list[list[int]], new: int,
                                step: str) -> tuple[object, list[list[str]], int]:  # fmt: skip
        """A tiny quantized model served with one compiled step recorded (``"decode"``:
        decode_forward with the GEMV forced on, which the CPU lacks by default; ``"prefill"``:
        mixed_forward): its tokens must equal lmforge.generate's. Returns the step's
        CompiledDecode, the call_function targets of each graph compiled and the layer count."""
        from lmforge.generate import generate
        from lmforge.model import ModelConfig, TransformerLM
        from lmforge.quant import quantize_model
        from lmforge.serve import Engine, SamplingParams, compiled

        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=128, context_length=64, d_model=64, n_layers=2, n_heads=4,
                          n_kv_heads=2, d_ff=128)  # fmt: skip
        model = quantize_model(TransformerLM(cfg).eval(), spec)
        want = [generate(model, [p], new, temperature=0)[0] for p in prompts]
        eng = Engine(model, block_size=4, num_blocks=16, compile=True)
        dec = compiled.CompiledDecode(eng.runner.model, eng.runner.cache, None, gemv=True,
                                      mixed=step == "prefill")  # fmt: skip
        graphs: list[list[str]] = []

        def backend(gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm.forward

        fn = compiled.decode_forward if step == "decode" else compiled.mixed_forward
        fn = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
        if step == "decode":
            dec._fn = fn
        else:
            dec._mixed_fn = fn
        eng.runner.decoder = dec
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        got = eng.generate(prompts, params)
        assert dec.failed is None and dec.mixed_failed is None
        assert [o.outputs[0].token_ids for o in got] == want
        assert graphs
        return dec, graphs, cfg.n_layers

    def test_compiled_decode_step_takes_the_partials_op() -> None:
        # a quantized model's GEMV decode step runs its int4 linears through the partials op
        from lmforge.quant import QuantSpec

        dec, graphs, layers = _serve_recording_graphs(
            QuantSpec("int4", 32), 0, [[3, 1, 4, 1, 5], [9, 2, 6]], 4, "decode"
        )
        assert dec.gemv is not None
        for ops in graphs:
            assert not any("int4_matmul" in o for o in ops)
            # q/k/v and w1/w3 stacked: four GEMVs a layer (q/k/v, o, w1/w3, w2), as a bf16
            # model has, and q/k/v's partials go straight into the fused RoPE + KV write +
            # attention op
            assert sum("int4_gemv_partials" in o for o in ops) == 4 * layers
            assert sum("rope_decode_attention" in o for o in ops) == layers

    def test_compiled_decode_step_takes_the_fp8_gemv_for_swept_shapes(monkeypatch) -> None:
        # fp8 (W8A8, per channel) with every shape of the model in the TABLE: the decode step
        # runs the fp8 GEMV, four a layer, q/k/v's partials into the fused attention op
        from lmforge.quant import QuantSpec
        from lmforge.quant import _gemv_triton as gt

        for n, k in ((128, 64), (64, 64), (256, 64), (64, 128)):  # q|k|v, o, w1|w3, w2
            monkeypatch.setitem(gt.TABLE, ("fp8", n, k, k),
                                gt.QuantGemvConfig(2, block_n=32, rows_kernel=True))  # fmt: skip
        # one sequence: batch-1 steps (a batch of 2 keeps the module's own product)
        _, graphs, layers = _serve_recording_graphs(QuantSpec("fp8"), 2, [[3, 1, 4, 1, 5]], 4,
                                                    "decode")  # fmt: skip
        assert graphs
        for ops in graphs:
            assert sum("fp8_gemv_partials" in o for o in ops) == 4 * layers
            assert sum("rope_decode_attention" in o for o in ops) == layers

    def test_compiled_prefill_step_runs_the_stacked_projections() -> None:
        # prefill through the compiled mixed step: the stacked int4 q/k/v and w1/w3 take the
        # dequant-fused GEMM
        from lmforge.quant import QuantSpec

        spec = QuantSpec("int4", 32, symmetric=True)
        prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]]
        dec, graphs, layers = _serve_recording_graphs(spec, 1, prompts, 3, "prefill")
        assert dec.mixed_on and all(isinstance(q, torch.nn.Module) for q, _ in dec.packed)
        for ops in graphs:  # q/k/v, o, w1/w3, w2: four GEMMs a layer
            assert sum("int4_matmul" in o for o in ops) == 4 * layers
