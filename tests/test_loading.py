"""The one loader of generate, chat and serve (lmforge.serve.loading): one source of three, the
same flags on every command, one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from lmforge.model import ModelConfig
from lmforge.serve.loading import add_model_source_args, load_for_serving, load_from_args
from lmforge.utils import LmforgeError

TINY = ModelConfig(vocab_size=64, context_length=32, d_model=16, n_layers=1, n_heads=2)


def _checkpoint(path: Path) -> None:
    from safetensors.torch import save_file

    from lmforge.config import RunConfig
    from lmforge.model import TransformerLM
    from lmforge.utils import config_to_toml

    path.mkdir(parents=True)
    save_file(TransformerLM(TINY).state_dict(), path / "model.safetensors")
    (path / "config.toml").write_text(config_to_toml(RunConfig(model=TINY)))


def test_flags_are_the_same_on_every_command() -> None:
    from lmforge.cli import build_parser

    parser = argparse.ArgumentParser()
    add_model_source_args(parser)
    args = parser.parse_args(["--gguf", "m.gguf", "--dtype", "float16", "--context-length", "8"])
    assert (args.checkpoint, args.hf, args.gguf, args.dtype) == (None, None, "m.gguf", "float16")
    with pytest.raises(SystemExit):  # exactly one source
        parser.parse_args(["--gguf", "a", "--hf", "b"])
    cli = build_parser()
    sub = next(a for a in cli._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "serve", "chat"):
        flags = {s for a in sub.choices[command]._actions for s in a.option_strings}
        assert {"--checkpoint", "--hf", "--gguf", "--device", "--dtype"} <= flags, command


def test_checkpoint_loads_in_eval_mode_and_dtype(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt")
    model, tok, template, name = load_for_serving(
        checkpoint=str(tmp_path / "ckpt"), device="cpu", dtype="bfloat16"
    )
    assert not model.training and next(model.parameters()).dtype == torch.bfloat16
    assert tok is None and template is None and name == "ckpt"
    ns = argparse.Namespace(checkpoint=str(tmp_path / "ckpt"), hf=None, gguf=None, device="auto",
                            dtype="auto", context_length=None)  # fmt: skip
    model, *_ = load_from_args(ns)
    assert next(model.parameters()).dtype == torch.float32  # auto on the CPU


def test_errors_are_one_line(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt")
    (tmp_path / "runs" / "x" / "checkpoints").mkdir(parents=True)
    for kw, message in [
        ({}, "exactly one of"),
        ({"checkpoint": "a", "hf": "b"}, "exactly one of"),
        ({"checkpoint": str(tmp_path / "nope")}, "not found"),
        ({"checkpoint": str(tmp_path / "runs")}, "did you mean"),
        ({"hf": str(tmp_path / "nope")}, "Hugging Face model folder not found"),
        ({"gguf": str(tmp_path / "nope.gguf")}, "not found"),
        ({"checkpoint": str(tmp_path / "ckpt"), "context_length": 16}, "applies to imports"),
        ({"checkpoint": str(tmp_path / "ckpt"), "dtype": "int8"}, "--dtype"),
        ({"checkpoint": str(tmp_path / "ckpt"), "device": "tpu"}, "invalid device"),
        ({"checkpoint": str(tmp_path / "ckpt"), "context_length": 1}, "at least 2"),
    ]:
        with pytest.raises(LmforgeError, match=message) as info:
            load_for_serving(device=kw.pop("device", "cpu"), **kw)
        assert "\n" not in str(info.value)


def test_engine_tokenizer_reads_padding_ids_as_no_text() -> None:
    from lmforge.serve.detok import make_detokenizer
    from lmforge.serve.loading import engine_tokenizer
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    assert engine_tokenizer(tok, 257) is tok and engine_tokenizer(None, 300) is None
    padded = engine_tokenizer(tok, 300)
    assert padded.eot_id == tok.eot_id and padded.encode("ab") == tok.encode("ab")
    ids = [104, 299, 105, 258]
    assert padded.decode(ids) == "hi"
    detok = make_detokenizer(padded)  # byte-exact path (id_to_bytes)
    assert "".join(detok.feed(i) for i in ids) + detok.flush() == "hi"

    class DecodeOnly:  # a tokenizer with decode() only, like the HF wrapper
        vocab_size, eot_id = 256, None

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode()

    view = engine_tokenizer(DecodeOnly(), 300)
    assert not hasattr(view, "id_to_bytes") and view.decode(ids) == "hi"
