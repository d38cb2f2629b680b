"""lmforge: an open, hackable, end-to-end language-model stack.

Stages live in subpackages (tokenizer, data, model, kernels, train, parallel, generate, eval, hf,
bench, scaling); each lists its public API in its own ``__init__.py``. Importing ``lmforge`` does no
work: it imports no stage and reads no environment variable.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
