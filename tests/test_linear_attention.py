"""Linear-attention mixers: the chunked forward equals the token-by-token decoding loop, a prefill
continued by steps (or by a second forward) equals one forward, packed sequences equal separate
ones, gradients reach every parameter, and the state has a constant, stated size. Gated DeltaNet
with grouped value heads (and a value width ≠ the key width) passes the same checks and equals
the plain layer whose q/k heads are copied to every value head of their group.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from lmforge.model.linear_attention import (
    GatedDeltaNet,
    LinearAttention,
    Mamba2Mixer,
    RecurrentState,
    ShortConv,
)

D = 32


def _make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gdn":
        return GatedDeltaNet(D, n_heads=2, head_dim=16, chunk_size=16)
    if kind == "gdn_grouped":  # Qwen3-Next's layout: 2 q/k heads of 16 → 4 value heads of 8
        return GatedDeltaNet(D, n_heads=2, head_dim=16, chunk_size=16, v_heads=4, v_head_dim=8)
    if kind == "mamba2":
        return Mamba2Mixer(D, d_state=16, head_dim=16, chunk_size=16)
    return LinearAttention(D, n_heads=2, head_dim=16, decay=kind == "retnet", chunk_size=16)


KINDS = ["gdn", "gdn_grouped", "mamba2", "retnet", "linear"]


def _x(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def _steps(layer, x: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
    ys = []
    for t in range(x.shape[1]):
        y, state = layer.step(x[:, t], state)
        ys.append(y)
    return torch.stack(ys, 1), state


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_forward_equals_step_loop(kind: str) -> None:
    layer = _make(kind)
    x = _x(2, 37)
    with torch.no_grad():
        y, state = layer(x)
        y_steps, state_steps = _steps(layer, x, layer.init_state(2))
    _close(y, y_steps)
    _close(state.ssm, state_steps.ssm)
    if state.conv is not None:
        _close(state.conv, state_steps.conv)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_step_and_prefill_then_forward_equal_one_forward(kind: str) -> None:
    layer = _make(kind)
    x = _x(2, 30)
    with torch.no_grad():
        y, _ = layer(x)
        y_pre, state = layer(x[:, :19])
        y_rest, _ = _steps(layer, x[:, 19:], state)
        y_cont, _ = layer(x[:, 19:], state=state)
    _close(torch.cat([y_pre, y_rest], 1), y)
    _close(torch.cat([y_pre, y_cont], 1), y)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_equal_separate_ones(kind: str) -> None:
    layer = _make(kind)
    lens = [5, 1, 21, 2]
    xs = [_x(1, n, seed=i) for i, n in enumerate(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        y, state = layer(torch.cat(xs, 1), cu_seqlens=cu)
        for i, xi in enumerate(xs):
            yi, si = layer(xi)
            _close(y[:, cu[i] : cu[i + 1]], yi)
            _close(state.ssm[i], si.ssm[0])
            if si.conv is not None:
                _close(state.conv[i], si.conv[0])


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind: str) -> None:
    layer = _make(kind)
    x = _x(2, 20).requires_grad_()
    y, state = layer(x)
    (y.square().mean() + state.ssm.square().mean()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_state_sizes_are_constant_and_stated() -> None:
    gdn = GatedDeltaNet(256, n_heads=4, head_dim=64)
    # conv over q, k, v (3·256 channels × 3 past inputs, bf16) + 4 heads of 64×64 float32.
    assert gdn.state_bytes(torch.bfloat16) == 3 * 256 * 3 * 2 + 4 * 64 * 64 * 4
    mamba = Mamba2Mixer(256, d_state=64, head_dim=64)
    assert mamba.state_bytes(torch.bfloat16) == (512 + 128) * 3 * 2 + 8 * 64 * 64 * 4
    state = gdn.init_state(3, torch.bfloat16)
    assert state.nbytes() == 3 * gdn.state_bytes(torch.bfloat16)
    with torch.no_grad():
        _, after = gdn(torch.randn(3, 40, 256), state=state)
    assert after.ssm.shape == state.ssm.shape and after.conv.shape == state.conv.shape


def test_grouped_value_heads_equal_copied_qk_heads() -> None:
    """A G layer with 2 q/k heads serving 4 value heads is the plain 4-head layer whose q/k
    projections (and their conv channels) repeat each head for its 2 value heads: q/k head j
    serves value heads 2j, 2j + 1 (transformers' repeat_interleave)."""
    torch.manual_seed(0)
    grouped = GatedDeltaNet(D, n_heads=2, head_dim=8, chunk_size=16, v_heads=4)
    plain = GatedDeltaNet(D, n_heads=4, head_dim=8, chunk_size=16)
    src = grouped.state_dict()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name in ("q_proj.weight", "k_proj.weight"):
                p.copy_(src[name].view(2, 8, D).repeat_interleave(2, 0).reshape(32, D))
            elif name == "conv.weight":  # channels q | k | v: q, k per head, repeated as above
                w = src[name]  # (2·16 + 32, W)
                q, k, v = w[:16], w[16:32], w[32:]
                rep = [t.view(2, 8, -1).repeat_interleave(2, 0).reshape(32, -1) for t in (q, k)]
                p.copy_(torch.cat([*rep, v]))
            else:
                p.copy_(src[name])
    x = _x(2, 23)
    with torch.no_grad():
        y, state = grouped(x)
        want, want_state = plain(x)
    _close(y, want)
    _close(state.ssm, want_state.ssm)
    assert state.ssm.shape == (2, 4, 8, 8) and state.conv.shape == (2, 2 * 16 + 32, 3)


def test_grouped_value_head_state_size_and_errors() -> None:
    gdn = GatedDeltaNet(256, n_heads=2, head_dim=64, v_heads=4, v_head_dim=32)
    # conv over q, k (2·2·64) and v (4·32), 3 past inputs in bf16 + 4 value heads of 64×32 fp32
    assert gdn.state_bytes(torch.bfloat16) == (2 * 128 + 128) * 3 * 2 + 4 * 64 * 32 * 4
    with pytest.raises(ValueError, match="not a multiple"):
        GatedDeltaNet(D, n_heads=2, head_dim=8, v_heads=3)


def test_short_conv_matches_torch_conv1d() -> None:
    torch.manual_seed(0)
    conv = ShortConv(6, width=4, bias=True)
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 9, 6)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    y, state = conv(x.reshape(18, 6), cu, None)
    want = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (3, 0)),
        conv.weight[:, None],
        conv.bias,
        groups=6,
    )  # (B, C, T)
    _close(y.reshape(2, 9, 6), torch.nn.functional.silu(want.transpose(1, 2)))
    _close(state, x[:, -3:].transpose(1, 2))


def test_bad_mamba_width_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        Mamba2Mixer(40, head_dim=64)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already the child")
def test_layers_on_the_triton_kernels_in_interpreter_subprocess() -> None:
    # The same tests with backend "auto" resolving to the Triton kernels (chunked and step).
    run_pytest_in_interpreter(__file__, timeout=1200)
