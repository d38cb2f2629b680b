"""Export a :class:`Tokenizer` to tiktoken (Rust core, corpus-scale speed) and to HF ``tokenizer.json``.

tiktoken ranks a merge by the id of the merged bytes and merges the lowest-ranked adjacent pair
first; that reproduces merge-list BPE exactly when every multi-byte token is the result of a merge
and merged ids rise with merge order. ``train_bpe`` lays ids out that way (and so does GPT-2), so
the export needs no id remapping; :func:`tiktoken_compatible` says whether a tokenizer qualifies.
Equality of ids with :meth:`Tokenizer.encode` is property-tested in ``tests/test_tokenizer.py``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.tokenizer._pretokenize import GPT2_PATTERN
from lmforge.tokenizer.tokenizer import Tokenizer, token_to_str
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

if TYPE_CHECKING:
    import tiktoken
    import tokenizers


def tiktoken_compatible(tokenizer: Tokenizer) -> str | None:
    """None when tiktoken reproduces ``tokenizer.encode`` exactly, else the reason it cannot."""
    special = set(tokenizer.special_ids.values())
    ordinary = {i: b for i, b in tokenizer.vocab.items() if i not in special}
    if len(set(ordinary.values())) != len(ordinary):
        return "the vocabulary repeats a byte string"
    merged_ids = []
    for a, b in tokenizer.merges:
        merged_ids.append(tokenizer._ids[a + b])
    if any(x >= y for x, y in itertools.pairwise(merged_ids)):
        return "merged-token ids do not rise with merge order"
    if len(set(merged_ids)) + 256 != len(ordinary):
        return "some multi-byte tokens are not produced by any merge"
    specials = tokenizer.special_tokens
    for s in specials:
        if any(t != s and t.startswith(s) for t in specials):
            # tiktoken's special-token alternation is unordered, so it may not pick the longest.
            return f"special token {s!r} is a prefix of another special token"
    return None


def to_tiktoken(tokenizer: Tokenizer, name: str | None = None) -> tiktoken.Encoding:
    """A ``tiktoken.Encoding`` whose ``encode(text, allowed_special="all")`` equals
    ``tokenizer.encode(text)``. Raises :class:`LmforgeError` when that cannot hold.

    Exercised by ``lmforge tokenizer encode`` (the fast path of :func:`encode_files`).
    """
    import tiktoken

    reason = tiktoken_compatible(tokenizer)
    if reason is not None:
        raise LmforgeError(f"cannot export this tokenizer to tiktoken: {reason}")
    special = set(tokenizer.special_ids.values())
    ranks = {b: i for i, b in tokenizer.vocab.items() if i not in special}
    return tiktoken.Encoding(
        name or f"lmforge-{tokenizer.sha256[:12]}",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=dict(tokenizer.special_ids),
    )


def to_hf_tokenizer(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """An HF ``tokenizers.Tokenizer`` (byte-level BPE, GPT-2 pre-tokenizer) with the same ids."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab: dict[str, int] = {}
    for i, b in tokenizer.vocab.items():
        if i not in tokenizer.special_ids.values():
            vocab[token_to_str(b)] = i
    for s, i in tokenizer.special_ids.items():
        # Added tokens reuse a vocabulary entry with the same content, which keeps our ids.
        vocab[s] = i
    merges = [(token_to_str(a), token_to_str(b)) for a, b in tokenizer.merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in tokenizer.special_tokens]
    )
    for s, i in tokenizer.special_ids.items():
        if hf.token_to_id(s) != i:
            raise LmforgeError(f"HF export: special token {s!r} did not keep id {i}")
    return hf


def save_hf_tokenizer_json(tokenizer: Tokenizer, path: str | os.PathLike) -> Path:
    """Write an HF ``tokenizer.json`` (loadable by ``tokenizers.Tokenizer.from_file`` and
    ``transformers.PreTrainedTokenizerFast``) atomically; returns the path."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    atomic_write_text(p, to_hf_tokenizer(tokenizer).to_str(pretty=False))
    return p


def hf_tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """A minimal ``tokenizer_config.json`` for ``transformers`` beside the exported file."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.eot_id is not None:
        eot = "<|endoftext|>"
        cfg.update(bos_token=eot, eos_token=eot, unk_token=None)
    return cfg
