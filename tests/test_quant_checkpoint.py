"""Quantized checkpoints and ``lmforge quantize``: save/load round trips per format, the CLI on a
tiny checkpoint with a byte tokenizer, and bad input as one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.quant import QuantSpec, quantize_model
from lmforge.quant.checkpoint import load_quantized, save_quantized
from lmforge.tokenizer import Tokenizer
from lmforge.train import save_checkpoint

CFG = ModelConfig(
    vocab_size=272, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
    tie_embeddings=True,
)  # fmt: skip


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(CFG).eval()


def _tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    tok_dir = tmp_path / "tok"
    _tokenizer().save(tok_dir)
    out = tmp_path / "ckpt"
    save_checkpoint(out, _model(), None, 0, config=RunConfig(model=CFG), tokenizer_dir=tok_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 80, encoding="utf-8")
    return out


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("int4", 32),
        QuantSpec("int4", 64, symmetric=True),
        QuantSpec("int8", None),
        QuantSpec("fp8", fp8_activations="dynamic"),
        QuantSpec("fp8", fp8_per_channel=False, fp8_activations="none"),
    ],
)
@torch.no_grad()
def test_save_load_round_trip(tmp_path: Path, spec: QuantSpec) -> None:
    model = quantize_model(_model(), spec)
    ids = torch.randint(0, 272, (2, 12))
    want = model(ids)
    out = save_quantized(model, _tokenizer(), tmp_path / "q", method="rtn", spec=spec, source="t")
    info = json.loads((out / "quantization.json").read_text())
    assert info["method"] == "rtn" and "layers.0.attn.q_proj" in info["modules"]
    loaded, tok = load_quantized(out)
    assert tok is not None and tok.vocab_size == 257
    torch.testing.assert_close(loaded(ids), want, rtol=0, atol=0)
    for (n, a), (_, b) in zip(model.named_buffers(), loaded.named_buffers(), strict=True):
        if "rope" not in n:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert loaded.lm_head.weight is loaded.token_embeddings.weight  # tied again


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_cli_quantize_and_load(ckpt: Path, tmp_path: Path, method: str) -> None:
    out = tmp_path / f"q-{method}"
    argv = ["quantize", "--checkpoint", str(ckpt), "--method", method, "--bits", "4"]
    argv += ["--group", "32", "--out", str(out), "--device", "cpu"]
    if method != "rtn":
        argv += ["--calib", str(tmp_path / "calib.txt"), "--calib-samples", "8"]
        argv += ["--calib-seq-len", "64"]
    assert main(argv) == 0
    model, tok = load_quantized(out)
    assert type(model.layers[1].ffn.w2).__name__ == "Int4Linear"
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        ref = _model()(ids)
        got = model(ids)
        if method == "rtn":  # the command's model is the library's
            want = quantize_model(_model(), QuantSpec("int4", 32))(ids)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - ref).norm() < 0.4 * ref.norm()  # int4 on a random tiny model is coarse


@pytest.mark.parametrize("weight_only", [True, False])
def test_cli_gptq_fp8(ckpt: Path, tmp_path: Path, weight_only: bool) -> None:
    out = tmp_path / "q-fp8"
    argv = ["quantize", "--checkpoint", str(ckpt), "--method", "gptq", "--format", "fp8"]
    argv += ["--bits", "8", "--out", str(out), "--device", "cpu", "--calib"]
    argv += [str(tmp_path / "calib.txt"), "--calib-samples", "8", "--calib-seq-len", "64"]
    argv += ["--fp8-weight-only"] if weight_only else []
    assert main(argv) == 0
    model, tok = load_quantized(out)
    q = model.layers[0].attn.q_proj
    assert type(q).__name__ == "Fp8Linear"
    assert q.activations == ("none" if weight_only else "dynamic")
    assert model.layers[0].attn.output_proj.input_scale is None  # GPTQ migrates nothing
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        ref, got = _model()(ids), model(ids)
    assert (got - ref).norm() < 0.1 * ref.norm()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--method", "hqq"], "unknown quantization method 'hqq'"),
        (["--bits", "3"], "--bits must be 4 or 8"),
        (["--group", "48"], "group size 48 does not divide the width 64"),
        (["--method", "gptq"], "--method gptq needs --calib FILE"),
        (["--method", "awq", "--calib", "nope.txt"], "calibration file not found"),
        (["--method", "gptq", "--group", "32", "--calib", "SHORT"], "need 65536"),
        (["--format", "fp8", "--bits", "4"], "--format fp8 stores 8-bit weights"),
        (["--gptq-clip", "l1"], "--gptq-clip must be hessian, mse or none, got 'l1'"),
        (["--gptq-order", "random"], "--gptq-order must be act or input"),
        (["--gptq-damp", "0"], "--gptq-damp must be > 0, got 0.0"),
        (["--format", "fp8", "--bits", "8", "--fp8-scale", "max"], "--fp8-scale must be mse or"),
        (["--smooth-alpha", "1.5"], "--smooth-alpha must be a number in [0, 1] or search"),
        (["--smooth-alpha", "auto"], "--smooth-alpha must be a number in [0, 1] or search"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    extra = [str(short) if e == "SHORT" else e for e in extra]
    out = tmp_path / "out"
    code = main(["quantize", "--checkpoint", str(ckpt), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "ckpt", "short.txt", "tok"]


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "lmforge quantize --gguf" in capsys.readouterr().out


@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int8", None)])
def test_engine_serves_a_quantized_checkpoint(tmp_path: Path, spec: QuantSpec) -> None:
    """``lmforge serve/generate/chat --checkpoint Q`` load a quantized folder through the shared
    loader, and the one engine decodes it token for token like the reference loop."""
    from lmforge.generate import generate
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.loading import load_for_serving

    out = save_quantized(quantize_model(_model(), spec), _tokenizer(), tmp_path / "q",
                         method="rtn", spec=spec, source="t")  # fmt: skip
    model, tok, _, _ = load_for_serving(checkpoint=str(out), device="cpu")
    assert tok is not None and type(model.layers[0].attn.q_proj).__name__ != "Linear"
    prompts = [[5, 17, 42, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    eng = Engine(model, block_size=16, num_blocks=32)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == want
