"""``auto`` model backends resolved to the measured-best concrete ones, in one pure function.

The model part of the fast path (the trainer's :func:`lmforge.train.resolve_fast_path` adds
the training part). Measurements behind each choice (GPT-2-small, batch 32×1024, compiled, on
an H200; benchmarks/RESULTS.md):

- attention: ``sdpa`` everywhere. On an H200 torch's SDPA runs cuDNN's fused attention, which
  measured faster end to end than lmforge's Triton FlashAttention-2; on a CPU SDPA is torch's
  fused kernel. ``flash`` stays an explicit choice (the readable Triton kernel).
- norm: ``reference`` everywhere: the compiler fuses the plain RMSNorm math with its neighbours,
  which measured faster end to end than the standalone Triton kernel.
- rope: ``packed`` on CUDA (q and k from one GEMM, rotated in one launch: 59.9 vs 61.1 ms/step
  against the reference), ``reference`` elsewhere.
- MLA layers (``attention_type = "mla"``) read the attention backend as ``reference`` (own
  math) or ``sdpa`` (torch's, for every other choice: lmforge's flash kernel needs equal q·k and
  v widths, and MLA's N + R differs from Ev); the rope/swiglu/norm choices do not reach them.
- swiglu: ``triton`` on CUDA (w1/w3 as one GEMM through the Triton gate: 56.4 vs 56.8 ms/step),
  ``reference`` elsewhere.

Exercised by ``pytest tests/test_train_fastpath.py``.
"""

from __future__ import annotations

import dataclasses

from lmforge.model.config import ModelConfig


def _triton_installed() -> bool:
    from lmforge.kernels import triton_available

    return triton_available()


def resolve_backends(cfg: ModelConfig, device_type: str, triton: bool | None = None) -> ModelConfig:
    """``cfg`` with every ``auto`` backend replaced by the measured-best one on ``device_type``.

    ``triton``: whether the Triton package is usable (None = look it up). Concrete choices are
    kept as given (a Triton backend still falls back per call where its kernel cannot run).
    """
    cuda = device_type == "cuda"
    if triton is None:
        triton = cuda and _triton_installed()
    kernels = cuda and triton
    choices = {
        "attention": "sdpa",
        "norm": "reference",
        "rope": "packed" if kernels else "reference",
        "swiglu": "triton" if kernels else "reference",
    }
    changes = {k: v for k, v in choices.items() if getattr(cfg, k) == "auto"}
    return dataclasses.replace(cfg, **changes) if changes else cfg
