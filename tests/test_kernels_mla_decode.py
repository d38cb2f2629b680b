"""The paged MLA decode kernel against a float64 reference on random (never zero) inputs: ragged
context lengths (one slot, exactly one block, many blocks), shuffled block tables, several block
sizes, forced partition counts (the split + combine path), head counts that are not powers of
two. The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (tiny shapes; bigger under
``-m slow``) and on the GPU with ``-m gpu``."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from lmforge.kernels.mla_decode import mla_decode, mla_decode_reference

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None

SHAPES = [  # (H, C, R, BS, lens)
    (4, 32, 16, 4, [5, 1, 11]),
    (3, 16, 8, 8, [17, 8]),  # H, R not powers of two / below 16; a context exactly one block
    (16, 64, 16, 16, [3, 40, 16]),
]
SLOW_SHAPES = [
    (16, 512, 64, 16, [300, 1, 129, 64]),  # DeepSeek-V2's widths
    (20, 96, 32, 32, [70, 200]),
    (80, 32, 16, 1, [33, 7]),  # more heads than one program holds; block size 1
]


def _setup(h, c, r, bs, lens, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    nb = sum(-(-n // bs) for n in lens) + 3
    cache = torch.randn(nb, bs, c + r, generator=g).to(device, dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks deliberately out of order
    tables, used = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[used : used + m])
        used += m
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), h, c + r, generator=g).to(device, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, cache, tables, bt.to(device), lens_t


def _float64(q, cache, tables, c, lens, scale):
    """Per sequence, straight from its table list, in float64."""
    outs = []
    for i, n in enumerate(lens):
        bs = cache.shape[1]
        rows = cache.cpu().double()[torch.tensor(tables[i])].reshape(-1, cache.shape[-1])[:n]
        p = (q[i].cpu().double() @ rows.T * scale).softmax(-1)  # (H, n)
        outs.append(p @ rows[:, :c])
        assert rows.shape[0] == n and n <= len(tables[i]) * bs
    return torch.stack(outs)  # (S, H, C)


def _check(shape, n_parts=None, dtype=torch.float32, device="cpu", use_triton=True, tol=2e-5):
    h, c, r, bs, lens = shape
    q, cache, tables, bt, lens_t = _setup(h, c, r, bs, lens, dtype, device)
    scale = 1 / math.sqrt(48.0)
    got = mla_decode(
        q, cache, bt, lens_t, kv_lora_rank=c, scale=scale, use_triton=use_triton, n_parts=n_parts
    )
    assert got.shape == (len(lens), h, c) and got.dtype == dtype
    want = _float64(q, cache, tables, c, lens, scale)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)


if not _CHILD:

    @pytest.mark.parametrize("shape", SHAPES)
    def test_reference_matches_float64(shape) -> None:
        _check(shape, use_triton=False, tol=1e-5)

    def test_reference_in_float64_is_exact() -> None:
        h, c, r, bs, lens = SHAPES[0]
        q, cache, tables, bt, lens_t = _setup(h, c, r, bs, lens, torch.float64)
        got = mla_decode_reference(q, cache, bt, lens_t, c, 0.25)
        torch.testing.assert_close(got, _float64(q, cache, tables, c, lens, 0.25))

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
    def test_kernel_under_interpreter() -> None:
        run_pytest_in_interpreter(__file__, "-m", "not slow", timeout=600)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
    def test_kernel_under_interpreter_slow_shapes() -> None:
        run_pytest_in_interpreter(__file__, "-m", "slow", timeout=1800)

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton not installed")
    @pytest.mark.parametrize("heads", [16, 128])
    def test_kernel_compiles_for_sm90_without_spills(heads) -> None:
        """No GPU needed: Triton compiles the kernel for sm_90 (H100/H200) at DeepSeek's widths
        (C = 512, R = 64, bf16, block size 16) with the launch config mla_decode uses, and
        ptxas reports no register spills (a spilling config is several times slower)."""
        import subprocess
        import tempfile
        from pathlib import Path

        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from lmforge.kernels._mla_decode_triton import _mla_decode_kernel, launch_config

        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if not ptxas.is_file():
            pytest.skip("Triton's bundled ptxas is missing")
        hb, nt, warps = launch_config(heads, 512, 16)
        ptrs = ("q", "cache", "bt", "lens", "out", "m", "l", "acc")
        types = ("*bf16", "*bf16", "*i32", "*i32", "*bf16", "*fp32", "*fp32", "*fp32")
        sig = {f"{p}_ptr": t for p, t in zip(ptrs, types, strict=True)}
        sig["scale"] = "fp32"
        for name in ("part_blocks", "n_parts", "n_heads", "stride_qs", "stride_qh", "stride_cb",
                     "stride_ct", "stride_bts", "stride_os", "stride_oh"):  # fmt: skip
            sig[name] = "i32"
        consts = {"HB": hb, "C": 512, "CP": 512, "R": 64, "RP": 64, "BS": 16, "NT": nt,
                  "SPLIT": True, "PREC": "tf32", "MMA": tl.bfloat16}  # fmt: skip
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(fn=_mla_decode_kernel, signature=sig, constexprs=consts)
        kernel = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
        )
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(kernel.asm["ptx"])
            done = subprocess.run(
                [str(ptxas), "--gpu-name=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert "0 bytes spill stores" in done.stderr, done.stderr[-2000:]

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("shape", SHAPES + SLOW_SHAPES)
    def test_kernel_on_gpu(shape, dtype) -> None:
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        _check(shape, dtype=dtype, device="cuda", tol=tol)
        _check(shape, n_parts=3, dtype=dtype, device="cuda", tol=tol)

else:

    @pytest.mark.parametrize("n_parts", [None, 1, 3])
    @pytest.mark.parametrize("shape", SHAPES)
    def test_kernel_matches_float64(shape, n_parts) -> None:
        _check(shape, n_parts=n_parts)

    def test_kernel_bf16_cache() -> None:
        _check(SHAPES[0], dtype=torch.bfloat16, tol=2e-2)

    def test_module_decode_through_kernel_matches_explicit() -> None:
        """MultiHeadLatentAttention.decode_paged on the kernel equals its explicit form."""
        from lmforge.model.mla import MLAConfig, MultiHeadLatentAttention

        cfg = MLAConfig(d_model=32, n_heads=4, kv_lora_rank=16, q_lora_rank=24,
                        qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8, max_seq_len=64)  # fmt: skip
        torch.manual_seed(0)
        m = MultiHeadLatentAttention(cfg)
        bs, n = 4, 10
        x = torch.randn(n, cfg.d_model)
        table = torch.tensor([[3, 0, 5]], dtype=torch.int32)
        pages = torch.zeros(6, bs, cfg.latent_dim)
        slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
        with torch.no_grad():
            m.prefill_paged(x[: n - 1], torch.arange(n - 1), pages, slots[:-1], table[0], n - 1)
            got = m.decode_paged(
                x[n - 1 :], torch.tensor([n - 1]), pages, slots[-1:], table,
                torch.tensor([n], dtype=torch.int32), use_triton=True,
            )  # fmt: skip
            torch.testing.assert_close(got[0], m(x[None])[0, -1], atol=1e-5, rtol=1e-5)

    @pytest.mark.slow
    @pytest.mark.parametrize("shape", SLOW_SHAPES)
    def test_kernel_matches_float64_slow(shape) -> None:
        _check(shape)
        _check(shape, n_parts=4)
