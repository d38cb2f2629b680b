"""Token shards: the pipeline's last step encodes documents into ``NAME.bin`` + ``NAME.bin.json``.

Format ``lmforge-tokens-v1``: raw little-endian token ids (uint16 when the vocabulary fits,
else uint32), each document followed by the end-of-text id; the JSON sidecar records
``{"format", "dtype", "count", "vocab_size", "tokenizer_sha256", "documents", "source_files",
"bytes"}``, as ``lmforge.tokenizer`` writes and reads it.

The tokenizer is lmforge's own (``from lmforge.tokenizer import Tokenizer``), loaded from the
folder a pipeline names; ``tokenizer = "bytes"`` selects a built-in byte-level stand-in
(ids 0–255, end-of-text 256) that needs no trained tokenizer, for tests and smoke runs.

Exercised by ``lmforge data run configs/pipelines/tokenize.toml`` and
``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lmforge.data.core import Document
from lmforge.utils.io import atomic_write, atomic_write_text

TOKENS_FORMAT = "lmforge-tokens-v1"


@dataclass
class _Encoder:
    encode: Any
    vocab_size: int
    eot_id: int | None
    sha256: str


def _byte_encoder() -> _Encoder:
    return _Encoder(
        encode=lambda t: list(t.encode("utf-8")),
        vocab_size=257,
        eot_id=256,
        sha256=hashlib.sha256(b"lmforge-bytes-v1").hexdigest(),
    )


def load_encoder(spec: str) -> _Encoder:
    """``"bytes"`` or a folder saved by ``lmforge tokenizer train`` → encoder and its identity.

    Uses the tokenizer's tiktoken export when it reproduces ``Tokenizer.encode`` exactly (as
    ``lmforge.tokenizer.encode_files`` does), so shards match ``lmforge tokenizer encode``'s ids.
    """
    if spec == "bytes":
        return _byte_encoder()
    from lmforge.tokenizer import Tokenizer, tiktoken_compatible, to_tiktoken

    tok = Tokenizer.load(spec)
    encode = tok.encode
    if tiktoken_compatible(tok) is None:
        enc = to_tiktoken(tok)

        def encode(text: str) -> list[int]:
            return enc.encode(text, allowed_special="all")

    return _Encoder(encode, int(tok.vocab_size), tok.eot_id, tok.sha256)


def write_token_shard(
    docs: Iterable[Document],
    path: str | os.PathLike,
    encoder: _Encoder,
    flush_tokens: int = 1 << 20,
    source_files: Sequence[str] = (),
) -> dict[str, Any]:
    """Encode ``docs`` into ``path`` (``.bin``) and its ``.bin.json`` sidecar, both atomically.

    The sidecar is the one ``lmforge.tokenizer.read_shard_info`` reads; returns it as a dict.
    """
    import numpy as np

    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    count = documents = nbytes = 0
    buf: list[int] = []
    with atomic_write(path, "wb") as f:
        for doc in docs:
            buf.extend(encoder.encode(doc.text))
            if encoder.eot_id is not None:
                buf.append(encoder.eot_id)
            documents += 1
            nbytes += len(doc.text.encode("utf-8"))
            if len(buf) >= flush_tokens:
                f.write(np.asarray(buf, dtype=dtype).tobytes())
                count += len(buf)
                buf = []
        f.write(np.asarray(buf, dtype=dtype).tobytes())
        count += len(buf)
    meta = {
        "format": TOKENS_FORMAT,
        "dtype": np.dtype(dtype).name,
        "count": count,
        "vocab_size": encoder.vocab_size,
        "tokenizer_sha256": encoder.sha256,
        "documents": documents,
        "source_files": list(source_files),
        "bytes": nbytes,
    }
    atomic_write_text(f"{path}.json", json.dumps(meta, indent=1) + "\n")
    return meta


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class TokenizeOptions:
    """``tokenize`` (last step only): write token shards instead of JSONL."""

    tokenizer: str
    "folder of a saved lmforge tokenizer, or 'bytes' for the byte-level stand-in"
