"""The chunked gated delta rule (Triton and torch) against the float64 token-by-token recurrence.

Forward outputs, final states and the gradients of every input (q, k, v, g, β, initial state) are
compared on random non-zero inputs, over several chunk sizes, ragged packed sequences (lengths not
multiples of the chunk) and head dims that are not powers of two. The Triton kernels run on CPU
under ``TRITON_INTERPRET=1`` in a child process (tiny shapes; larger ones under ``slow``); the
``gpu`` tests check the same on the device, backward included (triton 3.6 on Hopper).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from _interp import run_pytest_in_interpreter
from lmforge.kernels.gated_delta import (
    gated_delta_chunked_torch,
    gated_delta_reference,
    gated_delta_rule,
    gated_delta_step,
)

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(B, T, H, K, V, n_seq, *, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)  # the delta rule is stable for ‖k‖ = 1
    v = r(B, T, H, V)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.6 - 0.01
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    h0 = r(n_seq, H, K, V) * 0.5
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta, h0)]


def _compare(run, B, T, H, K, V, cu=None, *, dtype=torch.float32, device="cpu", tol=1e-5):
    """Run ``run(q, k, v, g, β, h0, cu)`` and the float64 reference; compare o, the final state
    and all six input gradients relative to each reference's largest entry."""
    n_seq = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    xs = [x.requires_grad_() for x in _inputs(B, T, H, K, V, n_seq, dtype=dtype, device=device)]
    ref = [x.detach().double().requires_grad_() for x in xs]
    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(device)
    w_h = torch.randn(n_seq, H, K, V, generator=gen, dtype=torch.float64).to(device)

    o_ref, h_ref = gated_delta_reference(
        *ref[:5], initial_state=ref[5], output_final_state=True, cu_seqlens=cu_t
    )
    ((o_ref * w_o).sum() + (h_ref * w_h).sum()).backward()
    o, h = run(*xs, cu_t)
    grads = torch.autograd.grad((o.double() * w_o).sum() + (h.double() * w_h).sum(), xs)
    got = {"o": o, "final state": h, **dict(zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads))}
    want = {"o": o_ref, "final state": h_ref}
    want.update({n: x.grad for n, x in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ref)})
    for name, w in want.items():
        err = (got[name].double() - w).abs().max().item()
        scale = max(1.0, w.abs().max().item())
        assert err <= tol * scale, f"{name}: max error {err:.3g} (scale {scale:.3g})"


# Cases: (B, T, H, K, V, cu_seqlens or None); ragged lengths and K, V not powers of two.
CASES = [
    (2, 37, 2, 16, 24, None),
    (1, 60, 2, 12, 16, [0, 5, 42, 60]),
    (1, 33, 1, 16, 32, [0, 1, 17, 33]),
]


def _chunked(chunk, backend):
    def run(q, k, v, g, beta, h0, cu):
        return gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            chunk_size=chunk, backend=backend,
        )  # fmt: skip

    return run


def _sm90_arg(name: str) -> tuple[str, bool]:
    # Triton signature types of the kernels' arguments: bf16 activations, fp32 decays/states.
    if name in ("CHUNKS", "CU", "COFF"):
        return "*i32", True
    if name == "scale":
        return "fp32", False
    bf16 = {
        "K_ptr",
        "V_ptr",
        "Q_ptr",
        "W_ptr",
        "U_ptr",
        "HS",
        "VN",
        "O_ptr",
        "DO",
        "DQ",
        "DK",
        "DV",
    }
    return ("*bf16" if name in bf16 else "*fp32"), True


if not _CHILD:

    @pytest.mark.parametrize("chunk", [16, 32, 64])
    @pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-K{c[3]}-V{c[4]}")
    def test_torch_chunked_matches_reference(case, chunk: int) -> None:
        _compare(_chunked(chunk, "torch"), *case[:5], case[5])

    def test_step_loop_matches_reference_and_prefill_then_step() -> None:
        q, k, v, g, beta, h0 = _inputs(2, 20, 3, 8, 8, 2, dtype=torch.float64)
        o_ref, h_ref = gated_delta_reference(
            q, k, v, g, beta, initial_state=h0, output_final_state=True
        )
        # Prefill 12 tokens with the chunked op, then decode the remaining 8 one at a time.
        o_pre, S = gated_delta_chunked_torch(
            q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12],
            initial_state=h0, output_final_state=True, chunk_size=16,
        )  # fmt: skip
        S = S.double()
        outs = [o_pre]
        for t in range(12, 20):
            o_t, S = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
            outs.append(o_t[:, None])
        torch.testing.assert_close(torch.cat(outs, 1), o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, h_ref, rtol=1e-10, atol=1e-10)

    def test_normalize_qk_and_defaults() -> None:
        q, k, v, g, beta, _ = _inputs(1, 9, 2, 8, 8, 1)
        o, h = gated_delta_rule(q * 3, k * 2, v, g, beta, normalize_qk=True, backend="torch")
        want, _ = gated_delta_reference(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta)
        assert h is None
        torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize(
        "change, message",
        [
            (dict(v=torch.zeros(1, 8, 3, 4)), "v must be"),
            (dict(g=torch.zeros(1, 8, 3)), "g must be"),
            (dict(initial_state=torch.zeros(2, 2, 8, 8)), "initial_state must be"),
            (dict(chunk_size=24), "chunk_size"),
            (dict(backend="cuda"), "backend must be"),
            (dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seqlens"),
        ],
    )
    def test_bad_inputs_are_one_clear_error(change: dict, message: str) -> None:
        q, k, v, g, beta, _ = _inputs(1, 8, 2, 8, 8, 1)
        kw = dict(v=v, g=g, backend="torch") | change
        with pytest.raises(ValueError, match=message):
            gated_delta_rule(q, k, kw.pop("v"), kw.pop("g"), beta, **kw)

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("select", ["not opcheck", "opcheck"], ids=["kernels", "custom-op"])
    def test_triton_kernels_in_interpreter_subprocess(select: str) -> None:
        # Two groups of similar length, so no single default-tier test runs long.
        run_pytest_in_interpreter(__file__, "-k", select, timeout=600)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_kernels_in_interpreter_subprocess_larger() -> None:
        run_pytest_in_interpreter(__file__, "-m", "slow", timeout=1800)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize(
        "kernel",
        ["_wy_fwd", "_state_fwd", "_output_fwd", "_dv_local", "_state_bwd", "_grad", "_step"],
    )
    def test_kernels_compile_for_sm90(kernel: str) -> None:
        # Hopper lowering on the CPU (no GPU): bf16, d = 128, chunk 64, the launches' warps,
        # stages and V blocks (forward state loop 3 stages deep; the output kernel all of V).
        from _sm90 import compile_sm90, ptxas_registers
        from lmforge.kernels import _gated_delta_triton as mod

        meta = dict(H=16, K=128, V=128, BT=64, BK=128, BV=64, PREC="tf32")
        extra = {
            "_wy_fwd": dict(LOG_BT=6, STORE_T=True),
            "_state_fwd": dict(HAS_H0=True, STORE_HT=True, BV=32),
            "_state_bwd": dict(HAS_DHT=True, STORE_DH0=True),
            "_output_fwd": dict(CUMSUM_G=False, BV=128),
        }.get(kernel, {})
        if kernel == "_step":  # no matmul: the decode step is a state read and write
            meta = dict(H=16, K=128, V=128, BK=128, BV=32, DELTA=True)
        stages = {"_state_fwd": mod._FWD_STATE_STAGES, "_state_bwd": 2}.get(kernel, 1)
        compiled = compile_sm90(
            getattr(mod, kernel), meta | extra, _sm90_arg, 8 if kernel == "_grad" else 4, stages
        )
        assert compiled.metadata.shared <= 232448  # the shared memory a block may use on H100/H200
        assert kernel == "_step" or "wgmma" in compiled.asm["ptx"]  # Hopper tensor cores
        ptxas_registers(compiled.asm["ptx"])  # ptxas accepts it

    @pytest.mark.gpu
    @pytest.mark.parametrize("chunk", [32, 64])
    @pytest.mark.parametrize(
        "case",
        [(2, 300, 4, 128, 128, None), (1, 1000, 4, 64, 96, [0, 1, 77, 640, 1000])],
        ids=["batch", "varlen"],
    )
    def test_gpu_triton_fp32_forward_backward_vs_float64(case, chunk: int) -> None:
        _compare(_chunked(chunk, "triton"), *case[:5], case[5], device="cuda", tol=2e-4)

    @pytest.mark.gpu
    def test_gpu_triton_bf16_forward_backward_vs_float64() -> None:
        # bf16 operands: tensor cores, fp32 accumulation and states.
        _compare(
            _chunked(64, "triton"), 2, 512, 4, 128, 128, dtype=torch.bfloat16, device="cuda",
            tol=5e-2,
        )  # fmt: skip

else:

    @pytest.mark.parametrize("chunk", [16, 32])
    @pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-K{c[3]}-V{c[4]}")
    def test_triton_matches_reference(case, chunk: int) -> None:
        _compare(_chunked(chunk, "triton"), *case[:5], case[5])

    def test_triton_float16_matches_reference() -> None:
        # 2-byte inputs take their own launch choices (the inverse's doubling steps on 2-byte
        # operands, the output kernel's whole-V block, a 3-deep state loop): forward and every
        # gradient against float64 to half-precision accuracy. float16, as the interpreter has
        # no bf16 matmul (numpy); the GPU tests cover bf16.
        _compare(_chunked(16, "triton"), 1, 60, 2, 16, 32, [0, 5, 42, 60], dtype=torch.float16,
                 tol=1e-2)  # fmt: skip

    def test_triton_without_states() -> None:
        q, k, v, g, beta, _ = _inputs(1, 40, 2, 16, 16, 1)
        o, h = gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="triton")
        want, _ = gated_delta_reference(
            q.double(), k.double(), v.double(), g.double(), beta.double()
        )
        assert h is None
        torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)

    def test_custom_ops_opcheck_and_compile_fullgraph() -> None:
        # The Triton path is torch.ops.lmforge.gated_delta_fwd/_bwd: schema, fake tensors and
        # autograd registration check out, and torch.compile traces it in one graph.
        q, k, v, g, beta, h0 = _inputs(1, 40, 2, 16, 16, 3)
        cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
        flat = [x[0].contiguous().requires_grad_() for x in (q, k, v, g, beta)]
        args = (*flat, h0.requires_grad_(), cu, 0.25, 16, True, 0)
        torch.library.opcheck(torch.ops.lmforge.gated_delta_fwd.default, args)

        def f(q, k, v, g, beta, h0):
            o, h = gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                chunk_size=16, backend="triton",
            )  # fmt: skip
            return o.square().sum() + h.sin().sum()

        xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
        want = torch.autograd.grad(f(*xs), xs)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = torch.autograd.grad(compiled(*xs), xs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_triton_step_matches_torch_step() -> None:
        q, k, v, g, beta, S = _inputs(3, 4, 2, 12, 20, 3)  # K, V not powers of two
        S_ref = S.double()
        for t in range(4):
            xs = [x[:, t] for x in (q, k, v, g, beta)]  # (N, H, ·)
            o, S = gated_delta_step(*xs, S, backend="triton")
            o_ref, S_ref = gated_delta_step(*(x.double() for x in xs), S_ref, backend="torch")
            torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(S.double(), S_ref, rtol=1e-5, atol=1e-5)

    @pytest.mark.slow
    @pytest.mark.parametrize("chunk", [32, 64])
    def test_triton_matches_reference_larger(chunk: int) -> None:
        _compare(_chunked(chunk, "triton"), 1, 300, 2, 64, 64, [0, 100, 101, 300])
