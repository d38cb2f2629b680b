"""Quantization-aware training: the fake-quantized forward equals the quantized module's weights,
gradients pass straight through, and the Trainer trains a wrapped model: after conversion its
quantized loss is below round-to-nearest's of the model QAT started from, and the converted
model computes what QAT trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain.config import SFTConfig
from lmforge.posttrain.core import Example
from lmforge.posttrain.sft import SFTObjective
from lmforge.quant import QuantLinear, QuantSpec, quantize_model
from lmforge.quant.apply import quantize_linear
from lmforge.quant.qat import FakeQuantLinear, convert_qat, fake_quantize, prepare_qat
from lmforge.train import TrainConfig, Trainer
from lmforge.utils.errors import LmforgeError

SPECS = [
    QuantSpec("int8", None),
    QuantSpec("int8", 32),
    QuantSpec("int4", 32),
    QuantSpec("int4", 64, symmetric=True),
    QuantSpec("fp8", fp8_activations="none"),
    QuantSpec("fp8", fp8_per_channel=False, fp8_activations="none"),
]
CFG = ModelConfig(vocab_size=64, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.group_size}-{s.symmetric}")
def test_fake_quantize_is_the_quantized_weight(spec: QuantSpec) -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    torch.testing.assert_close(fake_quantize(w, spec), quantize_linear(w, spec).dequantize(),
                               rtol=0, atol=0)  # fmt: skip


def test_straight_through_gradient() -> None:
    w = torch.nn.Parameter(torch.randn(16, 64, dtype=torch.float64) * 0.1)
    m = FakeQuantLinear(w, QuantSpec("int4", 32))
    x = torch.randn(5, 64, dtype=torch.float64)
    m(x).pow(2).sum().backward()
    wq = fake_quantize(w, m.spec).double()
    # d/dw of ||x ŵᵀ||² with ŵ's gradient passed to w unchanged: 2 (x ŵᵀ)ᵀ x
    torch.testing.assert_close(w.grad, 2 * (x @ wq.t()).t() @ x)


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(CFG)


def _data() -> list[Example]:
    g = torch.Generator().manual_seed(1)
    return [Example(torch.randint(0, 64, (32,), generator=g).tolist(), [True] * 32)
            for _ in range(16)]  # fmt: skip


def _train(model: TransformerLM, steps: int, lr: float, out: Path) -> None:
    tc = TrainConfig(out_dir=str(out), device="cpu", precision="fp32", batch_size=8,
                     max_steps=steps, lr=lr, min_lr=lr, schedule="constant", warmup_steps=0,
                     weight_decay=0.0, eval_every=0, save_every=0, log_every=1, plot=False,
                     progress=False)  # fmt: skip
    obj = SFTObjective(_data(), SFTConfig(packing=False), 8, "cpu", seed=0)
    Trainer(RunConfig(train=tc), model=model, objective=obj).run()


@torch.no_grad()
def _loss(model: TransformerLM) -> float:
    ids = torch.tensor([e.tokens for e in _data()])  # (B, T)
    logits = model(ids[:, :-1])  # (B, T-1, V)
    return float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))


def test_qat_in_the_trainer_lowers_the_quantized_loss(tmp_path: Path) -> None:
    spec = QuantSpec("int4", None, symmetric=True)
    model = _model()
    _train(model, 30, 1e-2, tmp_path / "float")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rtn = quantize_model(_with(state), spec)
    qat = prepare_qat(_with(state), spec)
    names = {n for n, _ in qat.named_parameters()}
    assert names == {n for n, _ in _model().named_parameters()}  # checkpoints stay plain
    _train(qat, 20, 3e-3, tmp_path / "qat")
    with torch.no_grad():
        fake = qat(torch.tensor([_data()[0].tokens]))
    qat = convert_qat(qat)
    assert any(isinstance(m, QuantLinear) for m in qat.modules())
    assert not any(isinstance(m, FakeQuantLinear) for m in qat.modules())
    with torch.no_grad():  # the converted model computes what QAT trained
        torch.testing.assert_close(qat(torch.tensor([_data()[0].tokens])), fake,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    assert _loss(qat) < 0.8 * _loss(rtn)


def _with(state: dict[str, torch.Tensor]) -> TransformerLM:
    m = _model()
    m.load_state_dict(state)
    return m.eval()


def test_group_not_dividing_is_one_line() -> None:
    with pytest.raises(LmforgeError, match="does not divide"):
        prepare_qat(_model(), QuantSpec("int4", 48))
