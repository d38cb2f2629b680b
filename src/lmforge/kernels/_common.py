"""Shared checks for the kernel modules: the one error type, Triton availability, device rules.

Nothing here imports Triton at module import time, so ``lmforge.kernels`` works on machines
without it (the Triton paths then raise :class:`KernelUnsupportedError`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KernelUnsupportedError(ValueError):
    """An input a fused kernel cannot handle (dtype, head dim, device, layout, missing Triton)."""


@functools.cache
def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def triton_available() -> bool:
    """Whether ``import triton`` would succeed (checked once, without importing it).

    While torch.compile traces it answers True without looking: Dynamo cannot trace importlib
    (torch < 2.13 graph-breaks on ``find_spec``), and the case it would catch — CUDA, no Triton —
    cannot compile anyway (Inductor generates Triton for CUDA); off CUDA the device check that
    follows it in :func:`check_triton_tensors` still refuses.
    """
    if torch.compiler.is_compiling():
        return True
    return _find_triton()


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``).

    Read at call time rather than import time: the variable is Triton's own switch (it must be set
    before Triton is imported) and CPU tests set it in a subprocess; kernels then accept CPU tensors.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_tensors(op: str, *tensors: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Raise one clear :class:`KernelUnsupportedError` unless Triton can run ``op`` on ``tensors``
    (``dtype``: the dtype they will have after a pending cast, e.g. autocast's)."""
    if not triton_available():
        raise KernelUnsupportedError(f"{op}: the Triton path needs the 'triton' package")
    want_cuda = not interpreting()
    for t in tensors:
        if want_cuda and t.device.type != "cuda":
            raise KernelUnsupportedError(
                f"{op}: the Triton path needs CUDA tensors, got device {t.device} "
                "(set TRITON_INTERPRET=1 to run it on CPU through Triton's interpreter)"
            )
        t_dtype = dtype or t.dtype
        if t_dtype not in TRITON_DTYPES:
            raise KernelUnsupportedError(
                f"{op}: dtype {t_dtype} is not supported (float16, bfloat16 or float32)"
            )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise KernelUnsupportedError(
            f"{op}: tensors on different devices {sorted(map(str, devices))}"
        )


@functools.cache
def ensure_interpreter_compat() -> None:
    """Let Triton 3.6's CPU interpreter run loops whose bounds derive from ``tl.program_id``.

    The interpreter stores scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy ≥ 2.4 rejects; we add the same hook converting with ``.item()``. Only called
    when ``TRITON_INTERPRET=1`` (tests on CPU); GPU runs never touch the interpreter.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_lmforge_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lmforge_compat = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast compute dtype active for ``device_type``, or None outside autocast.

    Fused ops cast their inputs to it (as autocast does for matmuls and SDPA) and then run with
    autocast disabled, so the dtypes inside a kernel are exactly the ones checked.
    """
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
