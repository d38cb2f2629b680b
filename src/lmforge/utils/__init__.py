"""Foundation helpers shared by every stage: errors, configuration, atomic I/O, runtime, corpora.

``utils`` imports nothing else from lmforge; every other package may import it.
"""

from lmforge.utils.config import (
    ConfigError,
    config_to_dict,
    config_to_toml,
    field_docs,
    from_dict,
    load_config,
    parse_overrides,
    save_config,
)
from lmforge.utils.corpus import default_corpus_files, expand_inputs, iter_texts
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_bytes, atomic_write_text, file_sha256
from lmforge.utils.runtime import Runtime

__all__ = [
    "ConfigError",
    "LmforgeError",
    "Runtime",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "config_to_dict",
    "config_to_toml",
    "default_corpus_files",
    "expand_inputs",
    "field_docs",
    "file_sha256",
    "from_dict",
    "iter_texts",
    "load_config",
    "parse_overrides",
    "save_config",
]
