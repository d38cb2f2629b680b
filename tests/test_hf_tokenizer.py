"""Tokenizers to and from Hugging Face folders: GPT-2-style BPE converts with identical ids, other
tokenizers are wrapped; exported folders load in transformers and encode the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import optional_import
from lmforge.hf import (
    HFTokenizer,
    export_model,
    import_model,
    load_hf_tokenizer,
    load_pretrained,
    save_as_checkpoint,
)
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer
from lmforge.utils import LmforgeError

tokenizers = optional_import("tokenizers")

TEXTS = [
    "the theme of the thesis",
    "  two  spaces\nand a newline",
    "naïve café 🎉 <|endoftext|>x",
    "",
]


def _lmforge_tokenizer() -> Tokenizer:
    words = [b"th", b"the", b" t", b" the", b"he", b"es", b"is", b" thes", b" thesis"]
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [
        (b"t", b"h"),
        (b"th", b"e"),
        (b" ", b"t"),
        (b" t", b"he"),
        (b"h", b"e"),
        (b"e", b"s"),
        (b"i", b"s"),
        (b" the", b"s"),
        (b" thes", b"is"),
    ]
    for i, w in enumerate(words):
        vocab[256 + i] = w
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def test_gpt2_style_tokenizer_round_trips_as_lmforge(tmp_path: Path) -> None:
    tok = _lmforge_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2
    )
    out = export_model(TransformerLM(cfg), tmp_path / "hf", tokenizer=tok)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eot_id
    back = load_hf_tokenizer(out)
    assert isinstance(back, Tokenizer)
    assert (
        back.vocab == tok.vocab
        and back.merges == tok.merges
        and back.special_ids == tok.special_ids
    )
    _, imported = import_model(out)
    assert isinstance(imported, Tokenizer) and imported.sha256 == tok.sha256


@pytest.mark.requires("transformers")
def test_transformers_loads_the_exported_tokenizer(tmp_path: Path) -> None:
    import transformers

    tok = _lmforge_tokenizer()
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2
    )
    out = export_model(TransformerLM(cfg), tmp_path / "hf", tokenizer=tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf_tok.decode(tok.encode(text)) == text
    assert hf_tok.eos_token_id == tok.eot_id


def _other_tokenizer_folder(d: Path) -> Path:
    """A byte-level BPE with a different (Llama-3-like) split regex: not GPT-2-style."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HF

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}| ?\p{L}+|\s+|[^\s\p{L}\p{N}]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["the theme of the thesis 12345 " * 20, *TEXTS], trainer)
    d.mkdir(parents=True, exist_ok=True)
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return d


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    tok = load_hf_tokenizer(_other_tokenizer_folder(tmp_path_factory.mktemp("other")))
    assert isinstance(tok, HFTokenizer)
    return tok


@settings(max_examples=25, deadline=None)
@given(st.text(max_size=40))
def test_wrapped_tokenizer_round_trips(wrapped: HFTokenizer, text: str) -> None:
    assert wrapped.decode(wrapped.encode(text)) == text


def test_other_tokenizers_are_wrapped(tmp_path: Path, wrapped: HFTokenizer) -> None:
    tok = wrapped
    assert tok.eot_id == tok._tok.token_to_id("<|im_end|>")
    assert tok.encode("12345") == tok.encode("123") + tok.encode("45")  # its own regex applies
    assert tok.vocab_size == 300
    # a model folder with that tokenizer imports; the checkpoint keeps it under hf_tokenizer/
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, context_length=32, d_model=32, n_layers=1, n_heads=2)
    model = TransformerLM(cfg)
    out = export_model(model, tmp_path / "hf", tokenizer=tok)
    _, imported = import_model(out)
    assert isinstance(imported, HFTokenizer) and imported.encode("the thesis") == tok.encode(
        "the thesis"
    )
    ckpt = save_as_checkpoint(model, imported, tmp_path / "ckpt", str(out))
    assert (ckpt / "hf_tokenizer" / "tokenizer.json").is_file() and not (
        ckpt / "tokenizer"
    ).exists()
    again, tok2 = load_pretrained(ckpt)
    assert isinstance(tok2, HFTokenizer) and tok2.eot_id == tok.eot_id
    assert again.config == model.config


def test_gpt2_vocab_and_merges_files_load_without_tokenizer_json(tmp_path: Path) -> None:
    tok = _lmforge_tokenizer()
    tok.save(tmp_path)  # vocab.json + merges.txt (GPT-2 format) + lmforge metadata
    back = load_hf_tokenizer(tmp_path)
    assert isinstance(back, Tokenizer) and back.sha256 == tok.sha256


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match=r"no tokenizer\.json"):
        load_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(LmforgeError, match="not valid JSON"):
        load_hf_tokenizer(tmp_path)
    tok = _lmforge_tokenizer()
    cfg = ModelConfig(vocab_size=100, context_length=32, d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(
        LmforgeError, match="tokenizer has 266 ids but the model's vocab_size is 100"
    ):
        export_model(TransformerLM(cfg), tmp_path / "x", tokenizer=tok)
