"""Chunked decayed linear attention and Mamba-2 SSD (Triton and torch) against float64 recurrences.

Forward, final states and every input gradient on random non-zero inputs, several chunk sizes,
ragged packed sequences and head dims that are not powers of two; the SSD wrapper (x, Δ, A, B, C,
D with grouped B/C) against the token loop written in Mamba-2's terms. Triton runs under
``TRITON_INTERPRET=1`` in a child process (tiny shapes; larger under ``slow``; ``gpu`` on device).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from lmforge.kernels.ssd import (
    linear_attention,
    linear_attention_chunked_torch,
    linear_attention_reference,
    linear_attention_step,
    ssd,
    ssd_reference,
    ssd_step,
)

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _check(got: dict, want: dict, tol: float) -> None:
    for name, w in want.items():
        err = (got[name].double() - w).abs().max().item()
        scale = max(1.0, w.abs().max().item())
        assert err <= tol * scale, f"{name}: max error {err:.3g} (scale {scale:.3g})"


def _compare_linear(backend, chunk, B, T, H, K, V, cu=None, *, decay=True, device="cpu",
                    dtype=torch.float32, tol=1e-5):  # fmt: skip
    n_seq = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(0)
    q, k = _rand(gen, B, T, H, K) * 0.5, _rand(gen, B, T, H, K) * 0.5
    v = _rand(gen, B, T, H, V)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5 - 0.01
    h0 = _rand(gen, n_seq, H, K, V)
    xs = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v, g, h0)]
    ref = [x.detach().double().requires_grad_() for x in xs]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    w_o = _rand(gen, B, T, H, V).to(device)
    w_h = _rand(gen, n_seq, H, K, V).to(device)
    kw = dict(output_final_state=True, cu_seqlens=cu_t, scale=0.7)

    def loss(o, h):
        return (o.double() * w_o).sum() + (h.double() * w_h).sum()

    g_ref = ref[3] if decay else None
    o_ref, h_ref = linear_attention_reference(*ref[:3], g_ref, initial_state=ref[4], **kw)
    loss(o_ref, h_ref).backward()
    o, h = linear_attention(
        *xs[:3], xs[3] if decay else None, initial_state=xs[4], chunk_size=chunk,
        backend=backend, **kw,
    )  # fmt: skip
    names = ["dq", "dk", "dv", "dg", "dh0"]
    idx = [0, 1, 2, 3, 4] if decay else [0, 1, 2, 4]
    grads = torch.autograd.grad(loss(o, h), [xs[i] for i in idx])
    got = {"o": o, "final state": h} | {names[i]: gr for i, gr in zip(idx, grads)}
    want = {"o": o_ref, "final state": h_ref} | {names[i]: ref[i].grad for i in idx}
    _check(got, want, tol)


def _compare_ssd(backend, chunk, cu=None, *, device="cpu", tol=1e-5):
    Bt, T, H, P, G, N = (1, 45, 4, 12, 2, 16) if cu else (2, 30, 4, 12, 2, 16)
    n_seq = Bt if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(2)
    x = _rand(gen, Bt, T, H, P)
    dt = torch.rand(Bt, T, H, generator=gen, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(H, generator=gen, dtype=torch.float64) - 0.2
    Bm, C = _rand(gen, Bt, T, G, N) * 0.5, _rand(gen, Bt, T, G, N) * 0.5
    D = _rand(gen, H)
    h0 = _rand(gen, n_seq, H, N, P)
    xs = [
        t.to(device=device, dtype=torch.float32).requires_grad_() for t in (x, dt, A, Bm, C, D, h0)
    ]
    ref = [t.detach().double().requires_grad_() for t in xs]
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    w_y, w_h = _rand(gen, Bt, T, H, P).to(device), _rand(gen, n_seq, H, N, P).to(device)

    def loss(y, h):
        return (y.double() * w_y).sum() + (h.double() * w_h).sum()

    def run(f, ts, **kw):
        return f(
            *ts[:5], D=ts[5], initial_state=ts[6], output_final_state=True, cu_seqlens=cu_t, **kw
        )

    y_ref, h_ref = run(ssd_reference, ref)
    loss(y_ref, h_ref).backward()
    y, h = run(ssd, xs, chunk_size=chunk, backend=backend)
    names = ["dx", "ddt", "dA", "dB", "dC", "dD", "dh0"]
    got = {"y": y, "final state": h} | dict(zip(names, torch.autograd.grad(loss(y, h), xs)))
    want = {"y": y_ref, "final state": h_ref} | {n: t.grad for n, t in zip(names, ref)}
    _check(got, want, tol)


CASES = [
    (2, 37, 2, 16, 24, None),
    (1, 60, 2, 12, 16, [0, 5, 42, 60]),
    (1, 33, 1, 16, 32, [0, 1, 17, 33]),
]
_IDS = [f"T{c[1]}-K{c[3]}-V{c[4]}" for c in CASES]


def _sm90_arg(name: str) -> tuple[str, bool]:
    # Triton signature types of the kernels' arguments: bf16 activations, fp32 decays/states.
    if name in ("CHUNKS", "CU", "COFF"):
        return "*i32", True
    if name == "scale":
        return "fp32", False
    bf16 = {"K_ptr", "V_ptr", "Q_ptr", "HS", "O_ptr", "DO", "DQ", "DK", "DV"}
    return ("*bf16" if name in bf16 else "*fp32"), True


if not _CHILD:

    @pytest.mark.parametrize("chunk", [16, 64])
    @pytest.mark.parametrize("case", CASES, ids=_IDS)
    def test_torch_chunked_matches_reference(case, chunk: int) -> None:
        _compare_linear("torch", chunk, *case)

    def test_torch_chunked_without_decay() -> None:
        _compare_linear("torch", 16, *CASES[1], decay=False)

    @pytest.mark.parametrize("cu", [None, [0, 7, 8, 45]], ids=["batch", "varlen"])
    def test_ssd_torch_matches_mamba_recurrence(cu) -> None:
        _compare_ssd("torch", 16, cu)

    def test_steps_continue_a_prefill() -> None:
        gen = torch.Generator().manual_seed(3)
        q, k, v = _rand(gen, 2, 20, 2, 8), _rand(gen, 2, 20, 2, 8), _rand(gen, 2, 20, 2, 6)
        g = -torch.rand(2, 20, 2, generator=gen, dtype=torch.float64)
        o_ref, h_ref = linear_attention_reference(q, k, v, g, output_final_state=True)
        o_pre, S = linear_attention_chunked_torch(
            q[:, :11], k[:, :11], v[:, :11], g[:, :11], output_final_state=True, chunk_size=16
        )
        outs = [o_pre]
        for t in range(11, 20):
            o_t, S = linear_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], S)
            outs.append(o_t[:, None])
        torch.testing.assert_close(torch.cat(outs, 1), o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, h_ref, rtol=1e-10, atol=1e-10)

    def test_ssd_step_loop_matches_reference() -> None:
        gen = torch.Generator().manual_seed(4)
        x, dt = _rand(gen, 2, 9, 4, 6), torch.rand(2, 9, 4, generator=gen, dtype=torch.float64)
        A, D = -torch.rand(4, generator=gen, dtype=torch.float64), _rand(gen, 4)
        Bm, C = _rand(gen, 2, 9, 1, 8), _rand(gen, 2, 9, 1, 8)
        y_ref, h_ref = ssd_reference(x, dt, A, Bm, C, D=D, output_final_state=True)
        S = torch.zeros(2, 4, 8, 6, dtype=torch.float64)
        for t in range(9):
            y_t, S = ssd_step(x[:, t], dt[:, t], A, Bm[:, t], C[:, t], S, D=D)
            torch.testing.assert_close(y_t, y_ref[:, t], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, h_ref, rtol=1e-10, atol=1e-10)

    def test_bad_groups_and_shapes_are_one_clear_error() -> None:
        x, dt, A = torch.randn(1, 4, 3, 2), torch.rand(1, 4, 3), -torch.rand(3)
        with pytest.raises(ValueError, match="multiple of the groups"):
            ssd(x, dt, A, torch.randn(1, 4, 2, 4), torch.randn(1, 4, 2, 4), backend="torch")
        with pytest.raises(ValueError, match="dt must be"):
            ssd(x, dt[..., :2], A, torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1, 4))

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_kernels_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__, timeout=600)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_kernels_in_interpreter_subprocess_larger() -> None:
        run_pytest_in_interpreter(__file__, "-m", "slow", timeout=1800)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("kernel", ["_state_fwd", "_output_fwd", "_state_bwd", "_grad"])
    def test_kernels_compile_for_sm90(kernel: str) -> None:
        # Hopper lowering on the CPU (no GPU): bf16, d = 128, chunk 64, the launch's warps.
        from _sm90 import compile_sm90, ptxas_registers
        from lmforge.kernels import _ssd_triton as mod

        meta = dict(H=16, K=128, V=128, BT=64, BK=128, BV=64, PREC="tf32")
        extra = {
            "_state_fwd": dict(HAS_H0=True, STORE_HT=True),
            "_state_bwd": dict(HAS_DHT=True, STORE_DH0=True),
            "_output_fwd": dict(CUMSUM_G=True),
        }.get(kernel, {})
        # The launches' warps and stages (2 only for the sequential state kernels).
        stages = 2 if kernel in ("_state_fwd", "_state_bwd") else 1
        compiled = compile_sm90(
            getattr(mod, kernel), meta | extra, _sm90_arg, 8 if kernel == "_grad" else 4, stages
        )
        assert compiled.metadata.shared <= 232448  # the shared memory a block may use on H100/H200
        assert "wgmma" in compiled.asm["ptx"]
        ptxas_registers(compiled.asm["ptx"])

    @pytest.mark.gpu
    @pytest.mark.parametrize("chunk", [32, 64])
    def test_gpu_triton_fp32_forward_backward_vs_float64(chunk: int) -> None:
        _compare_linear("triton", chunk, 2, 300, 4, 128, 128, device="cuda", tol=2e-4)
        _compare_linear(
            "triton", chunk, 1, 1000, 4, 64, 96, [0, 1, 77, 640, 1000], device="cuda", tol=2e-4
        )
        _compare_ssd("triton", chunk, [0, 7, 8, 45], device="cuda", tol=2e-4)

    @pytest.mark.gpu
    def test_gpu_triton_bf16_forward_backward_vs_float64() -> None:
        _compare_linear(
            "triton", 64, 2, 512, 4, 128, 128, device="cuda", dtype=torch.bfloat16, tol=5e-2
        )
        # The float32 chunk-64 failure's shapes (short packed sequences, K = 16, V = 12) at the
        # training dtype, which keeps chunk 64 (float32 runs in chunks of 32 on the GPU).
        _compare_linear(
            "triton", 64, 1, 45, 4, 16, 12, [0, 7, 8, 45], device="cuda", dtype=torch.bfloat16,
            tol=5e-2,
        )  # fmt: skip

else:

    @pytest.mark.parametrize("chunk", [16, 32])
    @pytest.mark.parametrize("case", CASES, ids=_IDS)
    def test_triton_matches_reference(case, chunk: int) -> None:
        _compare_linear("triton", chunk, *case)

    def test_triton_without_decay_and_ssd() -> None:
        _compare_linear("triton", 16, *CASES[1], decay=False)
        _compare_ssd("triton", 16, [0, 7, 8, 45])

    def test_custom_ops_opcheck() -> None:
        # torch.ops.lmforge.decay_linear_attn_fwd/_bwd: schema, fakes, autograd registration.
        gen = torch.Generator().manual_seed(6)
        q, k, v = (torch.randn(40, 2, 16, generator=gen).requires_grad_() for _ in range(3))
        g = (-torch.rand(40, 2, generator=gen)).requires_grad_()
        h0 = torch.randn(3, 2, 16, 16, generator=gen).requires_grad_()
        cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
        args = (q, k, v, g, h0, cu, 0.5, 16, True, 0)
        torch.library.opcheck(torch.ops.lmforge.decay_linear_attn_fwd.default, args)

    @pytest.mark.parametrize("decay", [True, False])
    def test_triton_step_matches_torch_step(decay: bool) -> None:
        gen = torch.Generator().manual_seed(5)
        q, k, v = _rand(gen, 3, 2, 12), _rand(gen, 3, 2, 12), _rand(gen, 3, 2, 20)
        g = -torch.rand(3, 2, generator=gen, dtype=torch.float64) if decay else None
        S = _rand(gen, 3, 2, 12, 20)
        f32 = [None if x is None else x.float() for x in (q, k, v, g, S)]
        o, S_new = linear_attention_step(*f32[:4], f32[4], scale=0.5, backend="triton")
        o_ref, S_ref = linear_attention_step(q, k, v, g, S, scale=0.5, backend="torch")
        torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S_new.double(), S_ref, rtol=1e-5, atol=1e-5)

    @pytest.mark.slow
    @pytest.mark.parametrize("chunk", [32, 64])
    def test_triton_matches_reference_larger(chunk: int) -> None:
        _compare_linear("triton", chunk, 1, 300, 2, 64, 64, [0, 100, 101, 300])
