"""The Transformer language model (single-device code; parallelism wraps it from outside).

Public API is listed in ``__all__``; the rest is internal.
"""

from lmforge.model.config import ModelConfig, default_d_ff

__all__ = ["ModelConfig", "default_d_ff"]
