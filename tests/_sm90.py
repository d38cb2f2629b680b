"""Hopper (sm_90a) cubin facts for a kernel's PTX, from the ptxas bundled in the Triton wheel,
so the kernel tests can check register use and spills without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable

import pytest


def ptxas_registers(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of ``ptx`` for sm_90a; skips the calling test
    when the Triton wheel bundles no ptxas."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton wheel bundles no ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    return regs, int(re.search(r"(\d+) bytes spill stores", out).group(1))


def compile_sm90(
    jit: object,
    constexprs: dict,
    arg_type: Callable[[str], tuple[str, bool]],
    warps: int,
    stages: int = 3,
) -> object:
    """``jit`` (a Triton kernel) lowered for sm_90 on the CPU, no GPU needed: each argument
    not in ``constexprs`` typed by ``arg_type(name) -> (signature type, divisible by 16)`` —
    the second as Triton would specialise it at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):  # type: ignore[attr-defined]
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name], div16 = arg_type(name)
        if div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit, sig, constexprs, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
