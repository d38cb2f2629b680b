"""Paged attention: the torch paths and the Triton decode kernel against a float64 reference on
random (never zero) inputs, ragged context lengths, GQA groups, shuffled block tables. The Triton
kernel runs under TRITON_INTERPRET=1 in a subprocess (tiny shapes) and on the GPU with -m gpu."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from lmforge.serve.attention import (
    paged_attention_float64,
    paged_decode,
    paged_decode_reference,
    paged_prefill,
    write_kv,
)

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None

SHAPES = [  # (S, H, K, E, BS, lens)
    (3, 4, 2, 16, 4, [5, 1, 11]),
    (2, 6, 1, 8, 8, [17, 8]),  # MQA, a context exactly one block
    (4, 4, 4, 32, 16, [3, 40, 16, 1]),  # MHA
]


def _setup(s, h, k, e, bs, lens, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    nb = sum(-(-n // bs) for n in lens) + 3
    kc = torch.randn(nb, bs, k, e, generator=g).to(device, dtype)
    vc = torch.randn(nb, bs, k, e, generator=g).to(device, dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks deliberately out of order
    tables, used = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[used : used + m])
        used += m
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(s, h, e, generator=g).to(device, dtype)
    return q, kc, vc, tables, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def _want(q, kc, vc, tables, lens):
    return torch.stack(
        [
            paged_attention_float64(q[i : i + 1].cpu(), kc.cpu(), vc.cpu(), tables[i], n)[0]
            for i, n in enumerate(lens)
        ]
    )


def _window_setup(window, dtype=torch.float32, device="cpu"):
    """Ragged contexts (150, 37, 1, 9) whose table entries before the window's first block
    point at a block of NaN (a sliding-window decode must never read them), 3 kv-heads of 2
    queries, and the float64 windowed answer."""
    lens = [150, 37, 1, 9]
    q, kc, vc, tables, bt, lens_t = _setup(4, 6, 3, 16, 4, lens, dtype)
    poison = kc.shape[0]
    kc = torch.cat([kc, torch.full_like(kc[:1], float("nan"))])
    vc = torch.cat([vc, torch.full_like(vc[:1], float("nan"))])
    want = []
    for i, n in enumerate(lens):
        lo = max(0, n - window)
        pos = torch.arange(lo, n)
        blocks = torch.tensor(tables[i])[pos // 4]
        keys = kc[blocks, pos % 4].double()  # (W', K, E)
        vals = vc[blocks, pos % 4].double()
        qi = q[i].double().view(3, 2, 16)  # (K, G, E)
        s = torch.einsum("kge,tke->kgt", qi, keys) / 4.0
        want.append(torch.einsum("kgt,tke->kge", s.softmax(-1), vals).reshape(6, 16))
        for b in range(lo // 4):
            bt[i, b] = poison
    return (
        q.to(device),
        kc.to(device),
        vc.to(device),
        bt.to(device),
        lens_t.to(device),
        (torch.stack(want)),
    )


if not _CHILD:

    @pytest.mark.parametrize("window", [1, 5, 16, 37, 400])
    def test_window_decode_reference_matches_float64(window) -> None:
        """The torch windowed decode (the W layer's fallback) against float64; its gather of
        the window's columns may include the block before the window, so no NaN block here."""
        from lmforge.model.kv_cache import window_decode

        q, kc, vc, _tables, bt, lens = _setup(4, 6, 3, 16, 4, [150, 37, 1, 9])
        _, _, _, _, _, want = _window_setup(window)
        got = window_decode(q, kc, vc, bt, lens, window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("shape", SHAPES)
    def test_decode_reference_matches_float64(shape) -> None:
        q, kc, vc, tables, bt, lens = _setup(*shape)
        got = paged_decode_reference(q, kc, vc, bt.long(), lens.long())
        torch.testing.assert_close(
            got.double(), _want(q, kc, vc, tables, shape[-1]), atol=1e-5, rtol=1e-5
        )

    @pytest.mark.parametrize("whole", [False, True])
    @pytest.mark.parametrize("shape", SHAPES)
    def test_prefill_chunks_match_float64(shape, whole) -> None:
        """Chunks after a cached prefix (lower-right causal) and whole prompts (is_causal,
        GQA in SDPA), block ids from the lists or sliced from the (S, M) table tensor."""
        _s, h, _k, e, _bs, lens = shape
        _q_all, kc, vc, tables, bt, _ = _setup(*shape)
        # chunks ending at the context: n//2 new queries, or the whole context
        q_lens = list(lens) if whole else [max(1, n // 2) for n in lens]
        g = torch.Generator().manual_seed(1)
        q = torch.randn(sum(q_lens), h, e, generator=g)
        got = paged_prefill(
            q, kc, vc, tables, q_lens, lens, block_table_tensor=bt if whole else None
        )
        start = 0
        for table, t, n in zip(tables, q_lens, lens, strict=True):
            want = paged_attention_float64(q[start : start + t], kc, vc, table, n)
            torch.testing.assert_close(got[start : start + t].double(), want, atol=1e-5, rtol=1e-5)
            start += t

    def test_write_kv_places_tokens_in_their_slots() -> None:
        kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
        k, v = torch.randn(2, 2, 8) + 3, torch.randn(2, 2, 8) + 3
        write_kv(kc, vc, torch.tensor([9, 2]), k, v)  # block 2 offset 1, block 0 offset 2
        torch.testing.assert_close(kc[2, 1], k[0])
        torch.testing.assert_close(vc[0, 2], v[1])
        assert int((kc != 0).any(-1).any(-1).sum()) == 2

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_decode_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__)

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("window", [1, 5, 16, 37, 400])
    def test_triton_window_decode_gpu(window, dtype) -> None:
        q, kc, vc, bt, lens, want = _window_setup(window, dtype, "cuda")
        got = paged_decode(q, kc, vc, bt, lens, use_triton=True, window=window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(
        "shape", [*SHAPES, (32, 32, 4, 64, 16, [*list(range(1, 1000, 31)), 1])]
    )
    def test_triton_decode_gpu(shape, dtype) -> None:
        _s, h, k, e, bs, lens = shape
        q, kc, vc, tables, bt, lens_t = _setup(len(lens), h, k, e, bs, lens, dtype, "cuda")
        got = paged_decode(q, kc, vc, bt, lens_t, use_triton=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            got.double().cpu(), _want(q, kc, vc, tables, lens), atol=tol, rtol=tol
        )

else:

    @pytest.mark.parametrize("shape", SHAPES)
    def test_triton_decode_matches_float64(shape) -> None:
        q, kc, vc, tables, bt, lens = _setup(*shape)
        got = paged_decode(q, kc, vc, bt, lens, use_triton=True)
        torch.testing.assert_close(
            got.double(), _want(q, kc, vc, tables, shape[-1]), atol=1e-5, rtol=1e-5
        )

    @pytest.mark.parametrize(
        ("n_parts", "dtype"),
        [(None, torch.float32), (1, torch.float32), (2, torch.float32), (3, torch.float32),
         (None, torch.float16), (1, torch.float16)],
    )  # fmt: skip
    def test_triton_split_context_matches_float64(n_parts, dtype) -> None:
        """Flash-decoding: partitions over long ragged contexts (some partitions empty for the
        short sequence), combined by the second kernel, equal the one-pass softmax."""
        from lmforge.serve._attention_triton import num_partitions, paged_decode_triton

        lens = [150, 37, 1]
        q, kc, vc, tables, bt, lens_t = _setup(3, 4, 2, 16, 4, lens, dtype)
        if n_parts is None:
            assert num_partitions(3, 2, bt.shape[1], 16)[0] == 3  # 38 blocks: 3 tiles
        got = paged_decode_triton(q, kc, vc, bt, lens_t, n_parts=n_parts)
        tol = 1e-5 if dtype == torch.float32 else 5e-3  # fp16: P rounded for the P·V tl.dot
        torch.testing.assert_close(got.double(), _want(q, kc, vc, tables, lens), atol=tol, rtol=tol)

    @pytest.mark.parametrize("n_parts", [None, 1, 2, 5])
    @pytest.mark.parametrize("window", [1, 5, 16, 37, 400])
    def test_triton_window_decode_matches_float64(window, n_parts) -> None:
        """A W layer's decode: the kernel skips the blocks before the window (their entries
        point at a NaN block here, so a read would show) and masks the slots before it in the
        window's first block; partitions wholly before the window drop out of the combine."""
        from lmforge.serve._attention_triton import paged_decode_triton

        q, kc, vc, bt, lens, want = _window_setup(window)
        got = paged_decode_triton(q, kc, vc, bt, lens, n_parts=n_parts, window=window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("layers", ["WW", "WWWA"])
    def test_engine_window_layers_decode_through_the_kernel(layers) -> None:
        """W layers' decode steps through the windowed kernel, over blocks given back behind the
        window (WW) and over per-sequence rings (WWWA): the reference loop's greedy tokens."""
        from lmforge.generate import greedy_generate_reference
        from lmforge.model import ModelConfig, TransformerLM
        from lmforge.serve import Engine, SamplingParams

        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=61, context_length=64, d_model=32, n_layers=len(layers),
                          n_heads=2, layers=layers, window=5)  # fmt: skip
        model = TransformerLM(cfg).eval()
        prompt = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        eng = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=8, use_triton=True)
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        (out,) = eng.generate([prompt], params)
        assert out.outputs[0].token_ids == greedy_generate_reference(model, prompt, 14)
