"""Ahead-of-time compile of every Triton kernel for Hopper (sm_90a) — no GPU needed.

Lowers each kernel's default config (and the attention autotune tables) through Triton's full
pipeline to a cubin with the ptxas bundled in the Triton wheel, so type errors, unsupported ops
and shared-memory overflows show up on a CPU machine. Also checks that attention uses Hopper's
``wgmma`` instructions. Marked ``slow`` (~10 s per kernel config on a busy CPU).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from _sm90 import compile_sm90, ptxas_registers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter active"),
]

SMEM_LIMIT = 232448  # bytes of shared memory a block may use on H100/H200
POINTERS = {"Q", "K", "V", "Out", "L", "DO", "Dl", "DK", "DV", "DQ", "X", "W", "Y", "RSTD", "DY",
            "DX", "DWP", "Z", "T", "SCALE", "LOSS", "A", "B", "DA", "DB", "C", "S"}  # fmt: skip


def _compile(
    jitfn, dtype: str, constexprs: dict, warps: int, stages: int, ptr_types: dict, ints=(),
    div16=(),
):  # fmt: skip
    # div16: integer arguments Triton specialises as divisible by 16 at run time (e.g. D, V)
    def arg(name: str) -> tuple[str, bool]:
        if name in ptr_types or (name in POINTERS and name not in ints):
            return ptr_types.get(name, "*" + dtype), True
        if name in ("sm_scale", "eps", "z_loss"):
            return "fp32", False
        return "i32", name.startswith("stride") or name in div16

    return compile_sm90(jitfn, constexprs, arg, warps, stages)


@pytest.mark.parametrize("e", [64, 128, 256])
@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_attention_kernels_compile_for_sm90(kind, e) -> None:
    from lmforge.kernels import _flash_triton as ft

    kernel = {"fwd": ft._attn_fwd, "dkdv": ft._attn_bwd_dkdv, "dq": ft._attn_bwd_dq}[kind]
    table = {"fwd": ft._FWD_CONFIGS, "dkdv": ft._DKDV_CONFIGS, "dq": ft._DQ_CONFIGS}[kind]
    bm, bn, warps, stages = table[ft._dim_class(e)][0]
    for causal, windowed in ((True, False), (False, False), (True, True)):
        constexprs = {"HEAD_DIM": e, "CAUSAL": causal, "BLOCK_M": bm, "BLOCK_N": bn,
                      "WINDOWED": windowed}  # fmt: skip
        compiled = _compile(
            kernel, "bf16", constexprs, warps, stages, {"L": "*fp32", "Dl": "*fp32"}
        )
        assert compiled.metadata.shared <= SMEM_LIMIT
        assert "wgmma.mma_async" in compiled.asm["ptx"], "attention should use Hopper wgmma"


def test_norm_loss_and_elementwise_kernels_compile_for_sm90() -> None:
    from lmforge.kernels import _cross_entropy_triton as ce
    from lmforge.kernels import _rms_norm_triton as rn

    for d in (768, 4096, 16384):
        for kernel, bwd in ((rn._rms_fwd, False), (rn._rms_bwd, True)):
            block_d, rows, warps = rn._tile(d, backward=bwd)
            compiled = _compile(kernel, "bf16", {"BLOCK_D": block_d, "ROWS": rows}, warps, 1,
                                {"RSTD": "*fp32", "DWP": "*fp32"}, div16=("D",))  # fmt: skip
            assert compiled.metadata.shared <= SMEM_LIMIT
            # D specialised as a multiple of 16 → 16-byte row accesses, not 2-byte ones.
            assert "ld.global.v4" in compiled.asm["ptx"], "rms_norm loads should vectorise"
            assert "st.global.v4" in compiled.asm["ptx"], "rms_norm stores should vectorise"
    ptrs = {"T": "*i64", "SCALE": "*fp32", "LOSS": "*fp32"}
    for grad in (True, False):
        # V is the vocabulary size (an int) in the cross-entropy kernel
        compiled = _compile(ce._ce_row, "bf16", {"COMPUTE_GRAD": grad, "BLOCK_V": 8192}, 16, 1,
                            ptrs, ints=("V",), div16=("V",))  # fmt: skip
        assert compiled.metadata.shared <= SMEM_LIMIT
        assert "ld.global.v4" in compiled.asm["ptx"], "cross-entropy row loads should vectorise"
    from lmforge.kernels import _elementwise_triton as ew

    for kernel in (ew._swiglu_fwd, ew._swiglu_bwd):
        compiled = _compile(kernel, "bf16", {"BLOCK": ew._BLOCK}, 8, 1, {"A": "*bf16"},
                            div16=("n",))  # fmt: skip
        assert compiled.metadata.shared <= SMEM_LIMIT
        assert "ld.global.v4" in compiled.asm["ptx"], "swiglu loads should vectorise"
    for kernel in (ew._swiglu_packed_fwd, ew._swiglu_packed_bwd):
        # F specialised as a multiple of 16: both halves of a row load 16 bytes at a time, for
        # one long row per program (dense F) and for 8 short rows per program (an expert's F 256)
        for f in (8192, 256):
            (_grid, kw) = ew._packed_launch(1024, f)
            consts = {"BLOCK": kw["BLOCK"], "ROWS": kw["ROWS"]}
            compiled = _compile(kernel, "bf16", consts, kw["num_warps"], 1,
                                {"AB": "*bf16", "DAB": "*bf16"}, div16=("F",))  # fmt: skip
            assert compiled.metadata.shared <= SMEM_LIMIT
            assert "ld.global.v4" in compiled.asm["ptx"], f"packed swiglu loads (F {f})"
            assert "st.global.v4" in compiled.asm["ptx"], f"packed swiglu stores (F {f})"


def test_rope_kernels_compile_for_sm90() -> None:
    from lmforge.kernels import _elementwise_triton as ew

    consts = {"SIGN": 1.0, "ROWS": 32, "BLOCK_H": 64}
    compiled = _compile(ew._rope, "bf16", consts, 4, 1, {"C": "*fp32", "S": "*fp32"}, ints=("T",),
                        div16=("HALF",))  # fmt: skip
    assert compiled.metadata.shared <= SMEM_LIMIT
    # Whole rows, not stride-2 pairs: 16-byte loads and stores of x and y.
    assert "ld.global.v4" in compiled.asm["ptx"], "rope loads should vectorise"
    assert "st.global.v4" in compiled.asm["ptx"], "rope stores should vectorise"
    # The packed form, both directions: whole rows on the packed side and on each of q and k.
    for to_split in (True, False):
        consts = {"SIGN": 1.0, "TO_SPLIT": to_split, "ROWS": 32, "BLOCK_H": 32}
        compiled = _compile(ew._rope_packed, "bf16", consts, 4, 1,
                            {"P": "*bf16", "C": "*fp32", "S": "*fp32"}, ints=("T",),
                            div16=("HALF",))  # fmt: skip
        assert "ld.global.v4" in compiled.asm["ptx"], f"packed rope loads ({to_split})"
        assert "st.global.v4" in compiled.asm["ptx"], f"packed rope stores ({to_split})"
    # The token-block launch (the default), both directions, as the launcher picks it for
    # 32768 tokens × (12 + 12) heads of E = 64 and of E = 128.
    for e in (64, 128):
        _, bt, hg, warps = ew._tokens_launch(32768, 12, 12, e // 2)
        for to_split in (True, False):
            consts = {"SIGN": 1.0, "TO_SPLIT": to_split, "BT": bt, "HG": hg, "BLOCK_H": e // 2}
            compiled = _compile(ew._rope_packed_tokens, "bf16", consts, warps, 1,
                                {"P": "*bf16", "C": "*fp32", "S": "*fp32"}, ints=("T",),
                                div16=("HALF",))  # fmt: skip
            ptx, what = compiled.asm["ptx"], f"token-block rope (E = {e}, split {to_split})"
            # A full tile's accesses: 16 bytes and unpredicated (no '@%p' guard on the line).
            assert re.search(r"^\s*ld\.global\.v4", ptx, re.M), f"{what}: loads"
            assert re.search(r"^\s*st\.global\.v4", ptx, re.M), f"{what}: stores"
            # cos/sin broadcast over the heads in registers, with no layout conversion through
            # shared memory (tokens lead the tile: each thread holds all HG heads of its token).
            assert compiled.metadata.shared == 0, f"{what}: {compiled.metadata.shared} B smem"
            # Registers for 32 resident warps per SM (65536 registers): all 32 programs an SM
            # can hold at 1 warp, many loads in flight (fewer measured well below the floor).
            regs, spills = ptxas_registers(ptx)
            assert spills == 0, what
            assert regs * 32 * 32 <= 65536, f"{what}: {regs} registers a thread"


@pytest.mark.parametrize("master", [False, True])
def test_adamw_kernel_compiles_for_sm90_without_spills(master: bool) -> None:
    # The default launch: vectorised accesses, no spills, and registers for at least two
    # programs per SM (65536 registers), so one program's table loads overlap another's data.
    # master: bf16 gradients read and bf16 copies written (master weights).
    import triton.language as tl

    from lmforge.kernels import _adamw_triton as at

    ptrs = {"P_TAB": "*i64", "G_TAB": "*i64", "M_TAB": "*i64", "V_TAB": "*i64", "T_TAB": "*i64",
            "C_TAB": "*i64", "NUMEL": "*i64", "CHUNK_TENSOR": "*i32", "CHUNK_START": "*i64",
            "HP": "*fp64", "OK": "*i1", "SCALE": "*fp32"}  # fmt: skip
    consts = {"BLOCK": at.BLOCK, "SLICES": at.SLICES, "C_DTYPE": tl.bfloat16, "HAS_COPY": master,
              "G_DTYPE": tl.bfloat16 if master else tl.float32}  # fmt: skip
    compiled = _compile(at._adamw_multi, "fp32", consts, at.WARPS, 1, ptrs)
    assert "ld.global.v4" in compiled.asm["ptx"], "adamw loads should vectorise"
    assert "st.global.v4" in compiled.asm["ptx"], "adamw stores should vectorise"
    regs, spills = ptxas_registers(compiled.asm["ptx"])
    assert spills == 0
    assert regs * 32 * at.WARPS * 2 <= 65536, f"{regs} registers a thread"
