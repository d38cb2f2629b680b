"""Byte-level BPE tokenizer (GPT-2 style). This is the public API of ``lmforge.tokenizer``.

- :func:`train_bpe` — train merges on files (parallel, streamed pre-tokenization; incremental
  merge loop).
- :class:`Tokenizer` — ``encode``/``decode``/``encode_iterable``; GPT-2 ``vocab.json``/
  ``merges.txt`` via ``from_files``; ``save``/``load`` of a self-contained folder.
- :func:`to_tiktoken`, :func:`save_hf_tokenizer_json` — exports with identical ids.
- :func:`encode_files`, :func:`read_token_shard`, :func:`read_shard_info` — token shards.

Depends only on ``lmforge.utils``. CLI: ``lmforge tokenizer train|encode``.
"""

from lmforge.tokenizer._pretokenize import GPT2_PATTERN
from lmforge.tokenizer.export import (
    save_hf_tokenizer_json,
    tiktoken_compatible,
    to_hf_tokenizer,
    to_tiktoken,
)
from lmforge.tokenizer.shards import (
    SHARD_FORMAT,
    ShardInfo,
    encode_files,
    read_shard_info,
    read_token_shard,
    shard_dtype,
)
from lmforge.tokenizer.tokenizer import Tokenizer, bytes_to_unicode
from lmforge.tokenizer.train import train_bpe

__all__ = [
    "GPT2_PATTERN",
    "SHARD_FORMAT",
    "ShardInfo",
    "Tokenizer",
    "bytes_to_unicode",
    "encode_files",
    "read_shard_info",
    "read_token_shard",
    "save_hf_tokenizer_json",
    "shard_dtype",
    "tiktoken_compatible",
    "to_hf_tokenizer",
    "to_tiktoken",
    "train_bpe",
]
