"""Every load and store of the linear-attention kernels stays inside its tensors.

The H200 run of the float32 SSD test at chunk 64 (packed lengths 7, 1, 37, K = 16, V = 12) ended in
an illegal memory access. The CPU interpreter dereferences raw addresses, so an out-of-bounds
index would pass an equivalence test there silently; here every kernel of the SSD and gated delta
paths (forward, backward, decode step) runs under :func:`lmforge.kernels._bounds.checked_bounds`
at chunk 64 — ragged sequences shorter than, equal to and longer than a chunk, a one-token
sequence, head dims that are not powers of two — and a deliberately overrunning kernel proves
the check fires. Triton runs under ``TRITON_INTERPRET=1`` in a child process.
"""

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
    def test_kernels_in_bounds_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__, timeout=900)

else:
    import triton
    import triton.language as tl

    from lmforge.kernels._bounds import checked_bounds
    from lmforge.kernels.gated_delta import gated_delta_step
    from lmforge.kernels.ssd import linear_attention_step
    from test_kernels_gated_delta import _chunked, _compare
    from test_kernels_ssd import _compare_linear, _compare_ssd

    @triton.jit
    def _copy(X, Y, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n + EXTRA, other=0.0)
        tl.store(Y + offs, x, mask=offs < n)

    def test_check_fires_on_an_overrun_and_passes_masked_lanes() -> None:
        x, y = torch.randn(10), torch.zeros(10)
        with checked_bounds():
            _copy[(1,)](x, y, 10, BLOCK=16, EXTRA=0)  # lanes 10..15 masked off: fine
            torch.testing.assert_close(y, x)
            with pytest.raises(Exception, match="out-of-bounds load"):
                _copy[(1,)](x, y, 10, BLOCK=16, EXTRA=1)

    @pytest.mark.parametrize("chunk", [16, 64])
    def test_ssd_kernels_in_bounds(chunk: int) -> None:
        with checked_bounds():
            _compare_ssd("triton", chunk, [0, 7, 8, 45])  # the H200 failure's shapes
            _compare_linear("triton", chunk, 1, 70, 2, 16, 12, [0, 1, 64, 70])
            _compare_linear("triton", chunk, 2, 65, 1, 12, 20)

    def test_gdn_kernels_in_bounds() -> None:
        with checked_bounds():
            _compare(_chunked(64, "triton"), 1, 70, 2, 16, 12, [0, 1, 64, 70])
            _compare(_chunked(64, "triton"), 2, 65, 1, 12, 20)

    def test_step_kernels_in_bounds() -> None:
        gen = torch.Generator().manual_seed(0)
        q, k = torch.randn(3, 2, 12, generator=gen), torch.randn(3, 2, 12, generator=gen)
        v, g = torch.randn(3, 2, 20, generator=gen), -torch.rand(3, 2, generator=gen)
        beta, S = torch.rand(3, 2, generator=gen), torch.randn(3, 2, 12, 20, generator=gen)
        with checked_bounds():
            o, S1 = linear_attention_step(q, k, v, g, S, backend="triton")
            o_ref, S1_ref = linear_attention_step(q, k, v, g, S, backend="torch")
            torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
            o, S2 = gated_delta_step(q, k, v, g, beta, S1, backend="triton")
            o_ref, S2_ref = gated_delta_step(q, k, v, g, beta, S1_ref, backend="torch")
            torch.testing.assert_close(S2, S2_ref, rtol=1e-5, atol=1e-5)
