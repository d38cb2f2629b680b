"""Upcycling a dense checkpoint into an MoE: equal outputs at init where that must hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.model import TransformerLM, load_preset
from lmforge.model import upcycle as M
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError


def _dense() -> TransformerLM:
    cfg = dataclasses.replace(load_preset("tiny"), d_ff=192)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "moe, zero_router",
    [
        (MoEConfig(n_experts=4, top_k=2), False),  # copies, any router
        (MoEConfig(n_experts=8, top_k=1, score="sigmoid"), False),
        (MoEConfig(n_experts=4, top_k=2, n_shared_experts=1), False),  # shared starts at 0
        (MoEConfig(n_experts=4, top_k=4, expert_d_ff=48), True),  # 4 slices, all chosen
        (MoEConfig(n_experts=4, top_k=2, every=2), False),
        # DeepSeek-V3 routing: groups, sigmoid, routed_scale (w2 divided by it)
        (
            MoEConfig(
                n_experts=8, top_k=2, score="sigmoid", n_groups=4, top_groups=2, routed_scale=2.5
            ),
            False,
        ),
    ],
)
def test_upcycled_output_equals_dense_at_init(moe: MoEConfig, zero_router: bool) -> None:
    dense = _dense()
    model = M.upcycle(dense, moe, zero_router=zero_router).eval()
    assert model.config.moe == moe
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), dense(IDS), rtol=1e-5, atol=1e-5)


def test_fine_grained_slices_with_top_k_below_granularity_differ() -> None:
    # Half the slices per token cannot reproduce the dense FFN: the test would catch a no-op.
    dense = _dense()
    model = M.upcycle(dense, MoEConfig(n_experts=4, top_k=2, expert_d_ff=48)).eval()
    with torch.no_grad():
        assert (model(IDS) - dense(IDS)).abs().max() > 1e-3
    ffn = model.layers[0].ffn
    w1 = dense.layers[0].ffn.w1.weight
    torch.testing.assert_close(ffn.w1[1], w1[48:96])
    torch.testing.assert_close(ffn.w2[1], dense.layers[0].ffn.w2.weight[:, 48:96] * 4)


def test_upcycle_rejects_bad_shapes() -> None:
    with pytest.raises(LmforgeError, match="must divide"):
        M.upcycle(_dense(), MoEConfig(n_experts=4, top_k=2, expert_d_ff=50))
    moe_model = M.upcycle(_dense(), MoEConfig(n_experts=4, top_k=2))
    with pytest.raises(LmforgeError, match="dense model"):
        M.upcycle(moe_model, MoEConfig(n_experts=4, top_k=2))
