"""Tokenizers between lmforge and Hugging Face folders.

Import: an HF ``tokenizer.json`` that is GPT-2-style byte-level BPE (BPE model, no normalizer,
GPT-2 pre-tokenization regex, byte-level decoder, no byte fallback) becomes an lmforge
:class:`~lmforge.tokenizer.Tokenizer` with the same ids (added tokens become special tokens).
Anything else (Llama-3's and Qwen's regexes, SentencePiece, WordPiece, normalizers) is kept as
:class:`HFTokenizer`, a thin wrapper over the ``tokenizers`` library with the same
``encode``/``decode``/``vocab_size``/``eot_id``/``save``/``load`` surface.

Simplification: the GPT-2 test is structural (the regex string must equal GPT-2's pattern); a
tokenizer with an equivalent but differently written regex stays wrapped, which is correct, only
slower. Chat templates and BOS insertion are not carried over (``encode`` adds no special tokens).

Export: an lmforge Tokenizer is written with ``lmforge.tokenizer.save_hf_tokenizer_json`` plus a
``tokenizer_config.json``; a wrapped HF tokenizer is copied as is.
Exercised by ``pytest tests/test_hf_tokenizer.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

__all__ = ["HFTokenizer", "load_hf_tokenizer", "save_tokenizer_for_hf"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
_EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "</s>", "<eos>")


class HFTokenizer:
    """An HF ``tokenizers`` tokenizer behind lmforge's tokenizer interface.

    ``encode`` never adds BOS/EOS (evaluation and training add the end-of-text id themselves);
    ``eot_id`` is the folder's EOS token (``tokenizer_config.json``, then ``config.json`` /
    ``generation_config.json``, then well-known names).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as _HF

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise LmforgeError(f"{self.folder}: tokenizer.json is missing")
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the Rust library raises its own exception types
            raise LmforgeError(f"{path}: cannot be loaded by tokenizers ({e})") from None
        self._eot = _find_eos_id(self.folder, self._tok.token_to_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eot_id(self) -> int | None:
        """End-of-sequence id, or None when the folder names none."""
        return self._eot

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens kept as text)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> Path:
        """Copy the tokenizer files into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name in _TOKENIZER_FILES:
            src = self.folder / name
            if src.is_file() and src.resolve() != (d / name).resolve():
                shutil.copyfile(src, d / name)
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        """Same as the constructor."""
        return cls(directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.folder}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _find_eos_id(folder: Path, token_to_id: Any) -> int | None:
    def read(name: str) -> dict:
        p = folder / name
        try:
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}

    eos = read("tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and token_to_id(eos) is not None:
        return int(token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        eid = read(name).get("eos_token_id")
        if isinstance(eid, list) and eid:
            eid = eid[0]
        if isinstance(eid, int):
            return eid
    for s in _EOT_CANDIDATES:
        if token_to_id(s) is not None:
            return int(token_to_id(s))
    return None


def _gpt2_reason(spec: dict[str, Any]) -> str | None:
    """None when ``tokenizer.json`` is GPT-2-style byte-level BPE, else why not."""
    from lmforge.tokenizer import GPT2_PATTERN

    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} is not BPE"
    for key in (
        "byte_fallback",
        "ignore_merges",
        "continuing_subword_prefix",
        "end_of_word_suffix",
    ):
        if model.get(key):
            return f"BPE option {key} is set"
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout is set"
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        if not steps[0].get("use_regex", True) or steps[0].get("add_prefix_space"):
            return "ByteLevel pre-tokenizer without the GPT-2 regex or with a prefix space"
    elif len(steps) == 2 and [s.get("type") for s in steps] == ["Split", "ByteLevel"]:
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern != GPT2_PATTERN or steps[1].get("use_regex") or steps[1].get("add_prefix_space"):
            return "its pre-tokenization regex is not GPT-2's"
    else:
        return "its pre-tokenizer is not GPT-2's byte-level split"
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return "its decoder is not byte-level"
    return None


def _to_lmforge(spec: dict[str, Any], where: str) -> Any:
    """An lmforge Tokenizer from a GPT-2-style ``tokenizer.json`` dict (None if a token won't map)."""
    from lmforge.tokenizer import Tokenizer
    from lmforge.tokenizer.tokenizer import str_to_token

    added = {int(t["id"]): str(t["content"]) for t in spec.get("added_tokens") or []}
    vocab: dict[int, bytes] = {}
    for s, i in spec["model"]["vocab"].items():
        if int(i) in added:
            continue
        b = str_to_token(s)
        if b is None:
            return None
        vocab[int(i)] = b
    if len({b for b in vocab.values() if len(b) == 1}) < 256:
        # Real byte-level vocabularies often lack bytes their training data never held
        # (SmolLM2 lacks 21). lmforge's encoder needs every byte as a token; `tokenizers`
        # silently drops an unknown byte. Keep HF's behaviour exactly: wrap it.
        return None
    for i, s in added.items():
        vocab[i] = s.encode("utf-8")
    merges: list[tuple[bytes, bytes]] = []
    for m in spec["model"].get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ba, bb = str_to_token(a), str_to_token(b)
        if ba is None or bb is None:
            return None
        merges.append((ba, bb))
    try:
        tok = Tokenizer(vocab, merges, list(added.values()))
    except LmforgeError as e:
        raise LmforgeError(f"{where}: {e}") from None
    if any(tok.special_ids[s] != i for i, s in added.items()):
        return None  # an added token collides with ordinary bytes: keep HF's behaviour
    return tok


def load_hf_tokenizer(folder: str | os.PathLike) -> Any:
    """The tokenizer of an HF model folder: lmforge ``Tokenizer`` if GPT-2-style, else wrapped.

    Returns :class:`lmforge.tokenizer.Tokenizer` or :class:`HFTokenizer`; a folder without
    ``tokenizer.json`` raises one line (``vocab.json`` + ``merges.txt`` alone load as GPT-2 files).
    """
    d = Path(folder)
    path = d / "tokenizer.json"
    if not path.is_file():
        if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
            from lmforge.tokenizer import Tokenizer

            return Tokenizer.from_files(d / "vocab.json", d / "merges.txt", ["<|endoftext|>"])
        raise LmforgeError(
            f"{d}: no tokenizer.json (SentencePiece-only tokenizer.model files are not supported)"
        )
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LmforgeError(f"{path}: not valid JSON ({e})") from None
    if _gpt2_reason(spec) is None:
        tok = _to_lmforge(spec, str(path))
        if tok is not None:
            return tok
    return HFTokenizer(d)


def gpt2_incompatibility(folder: str | os.PathLike) -> str | None:
    """Why an HF folder's tokenizer stays wrapped (None when it converts to lmforge's)."""
    path = Path(folder) / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    reason = _gpt2_reason(spec)
    if reason is None:
        from lmforge.tokenizer.tokenizer import str_to_token

        found = {str_to_token(t) for t in (spec.get("model") or {}).get("vocab") or {}}
        lacking = sum(bytes([x]) not in found for x in range(256))
        if lacking:
            reason = f"the vocabulary lacks {lacking} of the 256 single bytes"
    return reason


def save_tokenizer_for_hf(tokenizer: Any, out_dir: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``transformers`` into ``out_dir``."""
    d = Path(out_dir)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(d)
        return
    from lmforge.tokenizer import save_hf_tokenizer_json

    save_hf_tokenizer_json(tokenizer, d / "tokenizer.json")
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    eot = tokenizer.eot_id
    if eot is not None:
        name = tokenizer.decode([eot])
        cfg.update(bos_token=name, eos_token=name)
    atomic_write_text(d / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")
