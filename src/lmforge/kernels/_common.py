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
    """Make Triton 3.6's CPU interpreter behave as the GPU does where our kernels need it.

    1. Loops whose bounds derive from ``tl.program_id``: the interpreter stores scalars as
       1-element arrays and converts them with ``int(array)``, which NumPy ≥ 2.4 rejects; we add
       the same hook converting with ``.item()``.
    2. float32 → bfloat16 casts: the interpreter drops the low mantissa bits (round toward
       zero) where the GPU's ``cvt.rn.bf16.f32`` rounds to nearest even; we round as torch (and
       the GPU) do, so bf16 results can be compared bit for bit.

    Only called when ``TRITON_INTERPRET=1`` (tests on CPU); GPU runs never touch the interpreter.
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

    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    truncate = builder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return truncate(self, src, dst_type)

    builder.create_fp_trunc = fp_trunc


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast compute dtype active for ``device_type``, or None outside autocast.

    Fused ops cast their inputs to it (as autocast does for matmuls and SDPA) and then run with
    autocast disabled, so the dtypes inside a kernel are exactly the ones checked.
    """
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def staged(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a host tensor for a ``non_blocking=True`` copy to ``device``: pinned when
    it is CUDA (a copy from pageable memory waits for the stream's queued work: a sync). The
    caching host allocator keeps the pinned block until the copy has read it."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
