"""lmforge eval on edge inputs: empty ppl text, --limit on perplexity, where the report goes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import RunConfig
from lmforge.eval.scoring import perplexity
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer
from lmforge.train import save_checkpoint
from lmforge.utils.errors import LmforgeError

EOT = "<|endoftext|>"
CTX = 16


def _tok() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])


def _model(tok: Tokenizer) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, context_length=CTX, d_model=32, n_layers=1, n_heads=2
    )
    return TransformerLM(cfg).eval()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A training run folder laid out as the trainer writes it: RUN/checkpoints/step_N."""
    tok = _tok()
    run = tmp_path / "runs" / "demo" / "train"
    tok_dir = tok.save(tmp_path / "tok")
    save_checkpoint(
        run / "checkpoints" / "step_0000007",
        _model(tok),
        None,
        7,
        config=RunConfig(model=_model(tok).config),
        tokenizer_dir=tok_dir,
    )
    return run


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]


def test_ppl_on_an_empty_file_refuses(
    tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    ckpt = run_dir / "checkpoints" / "step_0000007"
    rc = main(["eval", "--checkpoint", str(ckpt), "--tasks", "ppl", "--ppl-text", str(empty),
               "--device", "cpu", "--no-progress"])  # fmt: skip
    errs = _errors(capsys)
    assert rc == 2 and len(errs) == 1 and "empty" in errs[0] and str(empty) in errs[0]
    assert not (run_dir / "eval_report.json").exists()
    with pytest.raises(LmforgeError, match="no tokens to score"):  # the library refuses too
        perplexity(_model(_tok()), _tok(), [""])


def test_limit_caps_perplexity_windows() -> None:
    tok, model = _tok(), _model(_tok())
    texts = ["abcdefgh" * 20, "second document " * 10]  # 160 + 160 bytes, CTX = 16
    full = perplexity(model, tok, texts)
    assert full.tokens == 320
    two = perplexity(model, tok, texts, max_windows=2)
    assert two.tokens == 2 * CTX and two.bytes == 2 * CTX  # one byte per token here
    # The capped score is the full document's first 32 tokens, scored the same way.
    assert two.nll == pytest.approx(perplexity(model, tok, [texts[0][: 2 * CTX]]).nll, rel=1e-6)
    many = perplexity(model, tok, texts, max_windows=12)  # 11 windows of the first doc + some
    assert many.tokens == 12 * CTX and many.bytes == 12 * CTX


def test_eval_limit_and_default_report_path(
    tmp_path: Path,
    run_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = tmp_path / "held.txt"
    text.write_text("held-out text for perplexity. " * 40)  # 1200 bytes
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ckpt = run_dir / "checkpoints" / "step_0000007"
    rc = main(["eval", "--checkpoint", str(ckpt), "--tasks", "ppl", "--ppl-text", str(text),
               "--limit", "3", "--device", "cpu", "--no-progress"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    report = json.loads((run_dir / "eval_report.json").read_text())
    assert report["results"]["ppl"]["tokens"] == 3 * CTX
    assert list(elsewhere.iterdir()) == []  # nothing in the current directory
    rc = main(["eval", "--checkpoint", str(run_dir), "--tasks", "ppl", "--ppl-text", str(text),
               "--device", "cpu", "--no-progress"])  # fmt: skip
    assert rc == 0
    assert (
        json.loads((run_dir / "eval_report.json").read_text())["results"]["ppl"]["tokens"] == 1200
    )


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_pointing_at_the_demo_folder_names_its_run(
    run_dir: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `lmforge demo --out runs/demo` writes its run to runs/demo/train (issue 21 item 2).
    args = ["--prompt", "x"] if command == "generate" else ["--tasks", "ppl"]
    rc = main([command, "--checkpoint", str(run_dir.parent), *args, "--device", "cpu"])
    errs = _errors(capsys)
    assert rc == 2 and len(errs) == 1 and f"(did you mean {run_dir}?)" in errs[0]
