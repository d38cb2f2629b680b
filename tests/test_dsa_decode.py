"""DSA (S layers) decodes: the reference loop's KV cache and the engine's pages against the
training forward.

An S layer caches its K/V and its indexer keys; each new token scores every cached key, keeps
its top-k over its past and attends to those only. Checked in fp32 against one full forward
of the same sequence (1e-5), with contexts longer than top-k (selection drops keys: the sparse
logits differ from the dense warm-up's), several top-k, GQA, with and without QK-norm and muP;
left-padded batches; ties broken the same way in every path; and in the engine: chunked
prefill, a prefix-cache hit, speculative decoding, the KV bytes an indexer key adds (engine
and :mod:`lmforge.model.accounting`), and the one-line refusal of a quantized KV cache.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate, greedy_generate_reference
from lmforge.model import KVCache, ModelConfig, TransformerLM, accounting
from lmforge.model.sparse_attention import select_mask, select_topk, set_dsa_stage, topk_mask
from lmforge.serve import Engine, SamplingParams
from lmforge.utils.errors import LmforgeError

V = 101
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _model(layers: str = "SASA", scale: float = 2.0, **kw) -> TransformerLM:
    torch.manual_seed(0)
    base = dict(
        vocab_size=V, context_length=64, d_model=64, n_layers=len(layers), n_heads=4,
        n_kv_heads=2, layers=layers, dsa_topk=4, dsa_index_heads=2, dsa_index_dim=8, window=5,
    )  # fmt: skip
    model = TransformerLM(ModelConfig(**(base | kw))).eval()
    with torch.no_grad():  # peaked logits: greedy is not decided by rounding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _incremental(model: TransformerLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) from a prefill of ``prefill`` tokens, then one token at a time."""
    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1])
    out = [model(ids[:, :prefill], kv_cache=cache)]
    out += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)  # (B, T, V)


@pytest.mark.parametrize("topk", [1, 3, 6])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("attention", ["reference", "sdpa"])
def test_kv_cache_decode_equals_the_training_forward(
    topk: int, qk_norm: bool, attention: str
) -> None:
    """Prefill 7 tokens, then decode 15 one at a time (T = 22 > top-k): every logit equals one
    full forward's, and the selection matters (the dense warm-up's logits differ)."""
    model = _model(dsa_topk=topk, qk_norm=qk_norm, attention=attention, scale=1.0)
    ids = torch.tensor([_ids(22), _ids(22, seed=2)])  # (2, 22)
    with torch.no_grad():
        full = model(ids)  # (2, 22, V)
        torch.testing.assert_close(_incremental(model, ids, 7), full, atol=1e-5, rtol=0)
        set_dsa_stage(model, "dense")
        dense = model(ids)
        torch.testing.assert_close(_incremental(model, ids, 7), dense, atol=1e-5, rtol=0)
    assert (dense - full).abs().max() > 1e-2  # top-k really dropped keys


def test_mup_decode_and_generate_equal_the_full_recompute() -> None:
    """muP's q scale in the sparse layer; greedy tokens of the cached loop equal recomputing
    the whole sequence for each token (no cache)."""
    model = _model("ASSA", scale=1.0, mup=True, mup_base_width=32, mup_base_head_dim=8)
    ids = torch.tensor([_ids(20)])
    with torch.no_grad():
        torch.testing.assert_close(_incremental(model, ids, 1), model(ids), atol=1e-5, rtol=0)
    model = _model("ASSA", mup=True, mup_base_width=32, mup_base_head_dim=8)
    prompt = _ids(9)
    assert generate(model, [prompt], 12, temperature=0)[0] == greedy_generate_reference(
        model, prompt, 12
    )


def test_left_padded_batch_equals_each_prompt_alone() -> None:
    """lmforge.generate's left-padded batch: padding keys are never selected, a row's
    positions (and so its indexer RoPE) ignore the padding before it."""
    model = _model("SGSW")
    prompts = [_ids(n, seed) for seed, n in enumerate((3, 14, 9))]
    batch = generate(model, prompts, 8, temperature=0)
    for p, got in zip(prompts, batch, strict=True):
        assert got == greedy_generate_reference(model, p, 8)


def test_select_mask_equals_the_training_selection_and_breaks_ties_early() -> None:
    """Each row of :func:`select_mask` over the causal past is :func:`select_topk`'s mask; with
    exact ties (ReLU zeros) the earlier keys win, whatever the row's length."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 9, 9, generator=g)
    scores[:, :, ::2] = 0.0  # ties at zero
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for k in (1, 3, 5, 9):
        want = topk_mask(*select_topk(scores, k), 9)  # (2, 9, 9)
        assert torch.equal(select_mask(scores, causal.expand(2, 9, 9), k), want)
        for t in range(9):  # the decode row of query t: its t + 1 keys only
            row = select_mask(scores[:, t : t + 1, : t + 1], causal[t : t + 1, : t + 1], k)
            assert torch.equal(row[:, 0], want[:, t, : t + 1])
    tied = torch.zeros(1, 1, 6)
    assert select_mask(tied, torch.ones(1, 1, 6, dtype=torch.bool), 2).tolist() == [
        [[True, True, False, False, False, False]]
    ]


def _check(model: TransformerLM, prompts: list[list[int]], outs) -> None:
    """Engine tokens equal lmforge.generate's; log-probs within 1e-5 of the full forward's."""
    for prompt, o in zip(prompts, outs, strict=True):
        out = o.outputs[0]
        assert out.token_ids == generate(model, [prompt], len(out.token_ids), temperature=0)[0]
        seq = prompt + out.token_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq]))[0], -1)
        want = lp[torch.arange(len(prompt) - 1, len(seq) - 1), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget", [3, 4, 64])
def test_engine_chunked_prefill_sees_earlier_chunks(budget: int) -> None:
    """Token budgets of 3 and 4 split the prompts into chunks (mixed with other sequences'
    decodes): a chunk's queries select among the earlier chunks' indexer keys in the pages."""
    model = _model()
    prompts = [_ids(n, seed) for seed, n in enumerate((3, 13, 21, 6))]
    eng = Engine(model, block_size=4, num_blocks=96, max_num_batched_tokens=budget)
    _check(model, prompts, eng.generate(prompts, GREEDY))
    assert eng.cache.index_k.shape == (2, eng.cache.num_blocks, 4, 8)


def test_engine_serves_the_dense_warm_up_stage() -> None:
    """A model in DSA's dense stage (set_dsa_stage "dense") attends to every past key in the
    engine too."""
    model = _model()
    set_dsa_stage(model, "dense")
    prompts = [_ids(n, seed) for seed, n in enumerate((13, 6))]
    eng = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=5)
    _check(model, prompts, eng.generate(prompts, GREEDY))


def test_engine_prefix_cache_hit_serves_both_keys() -> None:
    """A cached block holds its tokens' K/V and indexer keys: a second request sharing 12
    prompt tokens takes three blocks from the cache and still gives the reference's output."""
    model = _model()
    first = _ids(17)
    second = [*first[:12], 5, 9, 2]
    eng = Engine(model, block_size=4, num_blocks=96)
    eng.generate([first], GREEDY)
    hits = eng.allocator.hits
    outs = eng.generate([second], GREEDY)
    assert eng.allocator.hits - hits == 3
    _check(model, [second], outs)


def test_engine_speculative_decoding() -> None:
    """Speculative decoding needs no roll-back for S layers (a rejected draft's K/V and indexer
    keys sit past the context and are overwritten): n-gram drafts on a repetitive prompt are
    accepted, and the tokens are the reference's."""
    from lmforge.serve.speculative import NgramDraft

    model = _model()
    prompt = _ids(5) * 4
    eng = Engine(model, block_size=4, num_blocks=64, speculative=NgramDraft())
    (out,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert eng.stats["spec_steps"] > 0
    assert out.outputs[0].token_ids == generate(model, [prompt], 16, temperature=0)[0]


def test_kv_bytes_count_the_indexer_keys() -> None:
    """Per token: K and V of the paged layers (A/S; the W layer beside them keeps a ring) plus
    E_I per S layer, in the engine's pages, its startup line and
    accounting.kv_cache_bytes_per_token."""
    model = _model("GSWS")
    eng = Engine(model, block_size=4, num_blocks=32)
    kv, index = 2 * 2 * 2 * 16 * 4, 2 * 8 * 4  # 2 K/V layers, 2 kv heads, E 16; 2 S layers, fp32
    pages = sum(t[:, 0].numel() * t.element_size() for t in (eng.cache.k, eng.cache.v))
    assert pages + eng.cache.index_k[:, 0].numel() * 4 == 4 * (kv + index)
    assert f"KV {kv + index} B per token" in eng.startup_line
    assert f"DSA top-4 (indexer keys {index} B of the KV per token)" in eng.startup_line
    assert accounting.kv_cache_bytes_per_token(model.config, 4) == kv + index


def test_quantized_kv_cache_refused_in_one_line() -> None:
    with pytest.raises(LmforgeError, match=r"sparse-attention \(S\) layers .*--kv-cache-dtype"):
        Engine(_model(), block_size=4, num_blocks=32, kv_cache_dtype="int8")


@pytest.mark.parametrize("dense", [False, True])
def test_batched_decode_step_equals_the_per_sequence_path(dense: bool) -> None:
    """A decode step's batched gather over padded block tables (the engine's decode path)
    equals the per-sequence loop that prefill chunks take, on random pages."""
    from lmforge.model.context import Context, StepOps
    from lmforge.model.sparse_attention import SparseAttention, paged_sparse_attention

    attn = _model().layers[0].attn
    assert isinstance(attn, SparseAttention)
    attn.dense_warmup = dense
    g = torch.Generator().manual_seed(3)
    nb, bs, kv, e, ei, h, j = 12, 4, 2, 16, 8, 4, 2
    k_cache, v_cache = torch.randn(2, 2, nb, bs, kv, e, generator=g)  # (L, NB, BS, K, E) each
    index_cache = torch.randn(2, nb, bs, ei, generator=g)  # (L_S, NB, BS, E_I)
    lens, tables = [7, 13, 2], [[3, 1], [0, 5, 7, 2], [9]]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)])
    q, k, v = (torch.randn(3, x, e, generator=g) for x in (h, kv, kv))
    iq, ik, iw = torch.randn(3, j, ei, generator=g), torch.randn(3, ei), torch.randn(3, j)
    outs = []
    for decode in (True, False):
        ctx = Context(
            torch.tensor(lens) - 1, slots, padded, torch.tensor(lens, dtype=torch.int32),
            k_cache.clone(), v_cache.clone(), StepOps(), decode=decode,
            q_lens=None if decode else [1, 1, 1], ctx_lens_list=None if decode else lens,
            tables_list=None if decode else tables, index_cache=index_cache.clone(),
        )  # fmt: skip
        outs.append(paged_sparse_attention(attn, q, k, v, iq, ik, iw, ctx))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
