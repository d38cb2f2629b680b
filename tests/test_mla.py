"""Multi-head latent attention: the explicit and the absorbed forms compute the same function
(fp32, 1e-5), prefill-then-decode equals a full recompute, the paged decode path equals the
explicit form, and bad shapes are one LmforgeError line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.model.layers import scaled_dot_product_attention
from lmforge.model.mla import MLAConfig, MultiHeadLatentAttention, PagedLatentCache
from lmforge.utils.errors import LmforgeError

CONFIGS = [
    MLAConfig(d_model=64, n_heads=4, kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, max_seq_len=64),
    MLAConfig(d_model=64, n_heads=3, kv_lora_rank=24, q_lora_rank=48, qk_nope_head_dim=8,
              qk_rope_head_dim=16, v_head_dim=16, max_seq_len=64),
]  # fmt: skip


def _module(cfg: MLAConfig, seed: int = 0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(cfg)
    with torch.no_grad():  # non-trivial norm gains, so a missing norm would show
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_explicit_equals_absorbed(cfg: MLAConfig, backend: str) -> None:
    m = _module(dataclasses.replace(cfg, backend=backend))
    x = torch.randn(2, 11, cfg.d_model)
    want = m(x)
    got, latent = m.decode_absorbed(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert latent.shape == (2, 11, cfg.latent_dim)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_explicit_form_matches_plain_multihead_attention(cfg: MLAConfig) -> None:
    """The explicit form is ordinary attention over K = [W_UK c ; k^R], V = W_UV c, written out
    here independently (per head, lmforge's reference attention)."""
    m = _module(cfg)
    x = torch.randn(1, 7, cfg.d_model)
    pos = torch.arange(7)
    q_nope, q_rope = m.project_q(x, pos)  # (1, H, T, N), (1, H, T, R)
    latent = m.compress_kv(x, pos)[0]  # (T, C+R)
    c, kr = latent[:, : cfg.kv_lora_rank], latent[:, cfg.kv_lora_rank :]
    outs = []
    for h in range(cfg.n_heads):
        rows = m.kv_b_proj.weight.view(cfg.n_heads, -1, cfg.kv_lora_rank)[h]  # (N+Ev, C)
        k = torch.cat([c @ rows[: cfg.qk_nope_head_dim].T, kr], -1)  # (T, N+R)
        v = c @ rows[cfg.qk_nope_head_dim :].T  # (T, Ev)
        q = torch.cat([q_nope[0, h], q_rope[0, h]], -1)  # (T, N+R)
        outs.append(scaled_dot_product_attention(q, k, v, torch.ones(7, 7, dtype=bool).tril()))
    want = m.output_proj(torch.cat(outs, -1))[None]
    torch.testing.assert_close(m(x, pos), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_prefill_then_decode_matches_full_recompute(cfg: MLAConfig) -> None:
    m = _module(cfg, seed=1)
    x = torch.randn(2, 13, cfg.d_model)
    full = m(x)  # (B, T, D) explicit, whole sequence
    out, cache = m.decode_absorbed(x[:, :8])  # prefill 8 tokens (absorbed form)
    torch.testing.assert_close(out, full[:, :8], atol=1e-5, rtol=1e-5)
    for t in range(8, 13):  # decode one token at a time over the growing latent cache
        step, new = m.decode_absorbed(x[:, t : t + 1], past_latent=cache)
        torch.testing.assert_close(step[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
        cache = torch.cat([cache, new], 1)
    # a prefill chunk after a cached prefix, explicit form (the engine's chunked prefill)
    chunk = m(x[:, 8:], past_latent=cache[:, :8])
    torch.testing.assert_close(chunk, full[:, 8:], atol=1e-5, rtol=1e-5)


def test_batched_positions_and_gradients() -> None:
    cfg = CONFIGS[1]
    m = _module(cfg)
    x = torch.randn(2, 5, cfg.d_model, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    out = m(x, pos)
    row1 = m(x[1:], pos[1])  # per-row positions equal the same positions given as (T,)
    torch.testing.assert_close(out[1:], row1, atol=1e-6, rtol=1e-6)
    out.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cfg", CONFIGS)
def test_paged_decode_matches_explicit(cfg: MLAConfig) -> None:
    """Three sequences of different lengths, blocks shuffled: the paged path (torch reference of
    the kernel here; the kernel itself in test_kernels_mla_decode.py) equals the explicit form."""
    m = _module(cfg, seed=2)
    lens, bs = [5, 9, 1], 4
    g = torch.Generator().manual_seed(0)
    cache = PagedLatentCache(1, 12, bs, cfg.latent_dim, "cpu", torch.float32)
    perm = torch.randperm(12, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-(n + 1) // bs)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(map(len, tables))
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    xs = [torch.randn(n + 1, cfg.d_model, generator=g) for n in lens]
    for i, n in enumerate(lens):  # prefill: write each prompt's latents at its slots
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        cache.write(0, slots, m.compress_kv(xs[i][None, :n])[0])
    x_new = torch.stack([x[-1] for x in xs])  # (S, D) the decode tokens
    positions = torch.tensor(lens)
    slots = torch.tensor([tables[i][n // bs] * bs + n % bs for i, n in enumerate(lens)])
    ctx_lens = torch.tensor([n + 1 for n in lens], dtype=torch.int32)
    got = m.decode_paged(x_new, positions, cache.latent[0], slots, bt, ctx_lens, use_triton=False)
    for i in range(len(lens)):
        want = m(xs[i][None])[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_chunked_paged_prefill_then_paged_decode_matches_explicit(cfg: MLAConfig) -> None:
    """One sequence: a 6-token chunk, a 5-token chunk over the cached prefix, then two decode
    steps, all through shuffled pages of block size 4: every row equals the explicit form."""
    m = _module(cfg, seed=3)
    bs, n = 4, 13
    x = torch.randn(n, cfg.d_model)
    full = m(x[None])[0]  # (T, D)
    pages = torch.zeros(9, bs, cfg.latent_dim)
    table = torch.tensor([7, 2, 5, 0], dtype=torch.int32)

    def slots_of(a: int, b: int) -> torch.Tensor:
        return torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(a, b)])

    for a, b in ((0, 6), (6, 11)):
        got = m.prefill_paged(x[a:b], torch.arange(a, b), pages, slots_of(a, b), table, b)
        torch.testing.assert_close(got, full[a:b], atol=1e-5, rtol=1e-5)
    for p in (11, 12):
        got = m.decode_paged(
            x[p : p + 1], torch.tensor([p]), pages, slots_of(p, p + 1), table[None],
            torch.tensor([p + 1], dtype=torch.int32), use_triton=False,
        )  # fmt: skip
        torch.testing.assert_close(got[0], full[p], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"kv_lora_rank": 128}, "must not exceed d_model"),
        ({"kv_lora_rank": 60, "n_heads": 2, "qk_nope_head_dim": 8, "v_head_dim": 8}, "below"),
        ({"q_lora_rank": 65}, "q_lora_rank"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
        ({"n_heads": 0}, "n_heads must be a positive integer"),
        ({"backend": "flash"}, "backend"),
    ],
)
def test_bad_shapes_are_one_line(change: dict, needle: str) -> None:
    cfg = dataclasses.replace(CONFIGS[0], **change)
    with pytest.raises(LmforgeError, match=needle) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_latent_cache_bytes() -> None:
    # DeepSeek-V2: C = 512, R = 64 -> 576 values per token per layer (1152 bytes in bf16)
    assert PagedLatentCache.bytes_per_block(1, 1, 576, torch.bfloat16) == 1152
    assert PagedLatentCache.bytes_per_block(4, 16, 576, torch.float32) == 4 * 16 * 576 * 4


class _MLAInBlock(torch.nn.Module):
    """The MLA module in a TransformerBlock's attention slot (the wiring's call signature):
    explicit form, or absorbed form over a contiguous latent cache it keeps itself."""

    def __init__(self, mla: MultiHeadLatentAttention) -> None:
        super().__init__()
        self.mla, self.absorbed, self.cache = mla, False, None

    def forward(self, x, token_positions=None, *, kv_cache=None, context=None):
        if not self.absorbed:
            return self.mla(x, token_positions)
        out, new = self.mla.decode_absorbed(x, token_positions, self.cache)
        self.cache = new if self.cache is None else torch.cat([self.cache, new], 1)
        return out


def test_model_logits_explicit_equal_absorbed_prefill_then_decode() -> None:
    """A 3-layer TransformerLM with MLA attention: the logits of the explicit form over the whole
    sequence equal those of an absorbed prefill followed by token-by-token absorbed decode."""
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=50, context_length=64, d_model=64, n_layers=3,
                                      n_heads=4)).eval()  # fmt: skip
    for i, layer in enumerate(model.layers):
        layer.attn = _MLAInBlock(_module(CONFIGS[i % 2], seed=i))
    idx = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        want = model(idx)  # (B, T, V)
        for layer in model.layers:
            layer.attn.absorbed = True
        got = [model(idx[:, :7], torch.arange(7))]
        got += [model(idx[:, t : t + 1], torch.tensor([t])) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_num_parameters(cfg: MLAConfig) -> None:
    m = MultiHeadLatentAttention(cfg)
    assert cfg.num_parameters == sum(p.numel() for p in m.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_chunk_after_prefix_on_cuda_equals_reference(cfg: MLAConfig) -> None:
    """The engine's prefill chunk on CUDA (lower-right causal bias, V zero-padded to the
    query/key width for the fused kernels) equals the reference form: fp32 1e-5, bf16 against
    the fp32 reference at bf16's tolerance; the output keeps V's width."""
    m = _module(cfg, seed=2).cuda()
    ref = _module(dataclasses.replace(cfg, backend="reference"), seed=2).cuda()
    x = torch.randn(2, 29, cfg.d_model, device="cuda")
    cache = m.compress_kv(x[:, :20], torch.arange(20, device="cuda"))
    want = ref(x[:, 20:], past_latent=cache)
    torch.testing.assert_close(m(x[:, 20:], past_latent=cache), want, atol=1e-5, rtol=1e-5)
    got = m.to(torch.bfloat16)(x[:, 20:].bfloat16(), past_latent=cache.bfloat16())
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
