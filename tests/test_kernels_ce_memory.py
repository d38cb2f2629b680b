"""The fused linear + cross-entropy's memory: its backward (mean/sum) scales the forward's dh and
dW in place, so the op never holds them twice (the H200 test's 533 MiB > 314 MiB budget at
8192×1024→128256 was that copy); a retained graph's second backward fails, never scales twice.
CPU, torch backend: the dispatch mode below sees every tensor the backward creates."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.kernels import fused_linear_cross_entropy
from lmforge.kernels.cross_entropy import default_chunk_rows, linear_cross_entropy_reference


class _NewTensors(TorchDispatchMode):
    """Records the element count of every tensor an op creates (in-place ops create none)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        held = {a.untyped_storage().data_ptr() for a in inputs}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            # a view or an in-place result shares an input's storage: nothing new allocated
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in held:
                self.sizes.append((str(func), o.numel()))
        return out


def _inputs(n: int = 64, d: int = 16, v: int = 300):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = (torch.randn(v, d, generator=gen) / 4).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    return h, w, t


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_scales_the_saved_gradients_in_place(reduction: str) -> None:
    h, w, t = _inputs()
    loss = fused_linear_cross_entropy(h, w, t, reduction=reduction, backend="torch")
    with _NewTensors() as seen:
        dh, dw = torch.autograd.grad(2.5 * loss, (h, w))
    # Nothing of dh's (N·D) or dW's (V·D) size is created: they are scaled where they are.
    assert max((size for _, size in seen.sizes), default=0) < h.numel(), seen.sizes
    ref = linear_cross_entropy_reference(h, w, t, reduction=reduction)
    want = torch.autograd.grad(2.5 * ref, (h, w))
    torch.testing.assert_close(dh, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, want[1], rtol=1e-5, atol=1e-6)


def test_a_retained_graph_cannot_be_scaled_twice() -> None:
    h, w, t = _inputs()
    loss = fused_linear_cross_entropy(h, w, t, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_create_graph_keeps_the_graph_intact() -> None:
    h, w, t = _inputs()
    loss = fused_linear_cross_entropy(h, w, t, backend="torch")
    g1 = torch.autograd.grad(loss, h, create_graph=True, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, h)[0]  # the saved dh was not scaled in place
    torch.testing.assert_close(g1.detach(), g2)


def ce_memory_figure(n: int, d: int, v: int, bytes_per_value: int = 2) -> dict[str, int]:
    """What the fused loss must hold beyond its inputs (mean/sum, both gradients wanted): dh
    (N·D) and dW (V·D), computed in the forward, plus one chunk of logits (rows × V), all in the
    input dtype; the backward adds nothing (it scales dh and dW in place)."""
    rows = default_chunk_rows(n, d, v)
    parts = {"dh": n * d, "dW": v * d, "chunk_logits": rows * v}
    return {k: x * bytes_per_value for k, x in parts.items()}


def test_memory_figure_of_the_h200_shape() -> None:
    """The GPU test's shape: 16 MiB dh + 250.5 MiB dW + 31.3 MiB chunk (128 rows) = 297.8 MiB;
    the copy the backward used to make added dh + dW again (533 MiB measured)."""
    fig = ce_memory_figure(8192, 1024, 128256)
    mib = {k: x / 2**20 for k, x in fig.items()}
    assert default_chunk_rows(8192, 1024, 128256) == 128
    assert mib == pytest.approx({"dh": 16.0, "dW": 250.5, "chunk_logits": 31.3125})
    total = sum(mib.values())
    assert total == pytest.approx(297.8, abs=0.05) and total + 16 == pytest.approx(313.8, abs=0.1)
    assert total + mib["dh"] + mib["dW"] - mib["chunk_logits"] == pytest.approx(533.0)
