"""Serving hybrid layer patterns: what tests/test_engine_switches.py's table does not cover.

The prefix-cache choice (off for linear layers: a repeated prompt is recomputed, never served
from blocks whose recurrent state is unknown; on for W), the reference loop's left-padded
batches through recurrent layers, S layers decoding (tests/test_dsa_decode.py has the rest),
the one-line refusal of speculative decoding with a recurrent model, the startup line's memory
figures, and the GPU path (eager decode).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate, greedy_generate_reference
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.linear_attention import StatePool
from lmforge.serve import Engine, SamplingParams
from lmforge.utils.errors import LmforgeError

V = 101
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _model(layers: str, **kw) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, context_length=64, d_model=64, n_layers=len(layers),
                      n_heads=4, layers=layers, window=5, **kw)  # fmt: skip
    return TransformerLM(cfg).eval()


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("layers", ["GGGA", "MMMA", "LLAA", "GMWA"])
def test_repeated_prompt_is_recomputed_not_cached(layers: str) -> None:
    """Linear layers turn the prefix cache off: the second identical request takes no cached
    block and still gives the reference's tokens (a hit would skip its recurrent state)."""
    model = _model(layers)
    prompt = _prompt(17)
    eng = Engine(model, block_size=4, num_blocks=64)
    assert not eng.allocator.enable_prefix_cache and "prefix cache off" in eng.startup_line
    want = greedy_generate_reference(model, prompt, 8)
    first = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    second = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert first == second == want and eng.allocator.hits == 0


def test_window_model_keeps_the_prefix_cache() -> None:
    """A W-only pattern keeps K/V only: a repeated prompt hits the cache and is still exact."""
    model = _model("WW")
    prompt = _prompt(17)
    eng = Engine(model, block_size=4, num_blocks=64)
    want = greedy_generate_reference(model, prompt, 8)
    assert eng.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert eng.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert eng.allocator.hits == 4  # the first 16 tokens: four full blocks


@pytest.mark.parametrize("layers", ["WW", "GW", "MWMW"])
def test_window_only_patterns_serve_sequences_longer_than_the_cache(layers: str) -> None:
    """Every paged layer a W layer (window 5): blocks behind a sequence's window go back to the
    pool, so 6 blocks of 4 tokens serve two 40-token sequences (10 blocks each without the
    window), chunked prefill included, with the reference loop's greedy tokens; no more than
    ceil((8 + 5 − 1) / 4) + 1 = 4 blocks a sequence are ever held."""
    model = _model(layers)
    prompts = [_prompt(29, 3), _prompt(23, 4)]
    eng = Engine(model, block_size=4, num_blocks=8, max_num_batched_tokens=8)
    assert eng.window == 5 and "blocks behind each window given back" in eng.startup_line
    want = [greedy_generate_reference(model, p, 40 - len(p)) for p in prompts]
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40 - len(p), ignore_eos=True))
    outs, most = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        most = max(most, eng.allocator.num_used)
    assert [outs[k] for k in sorted(outs)] == want
    assert most <= 2 * 4 and eng.stats["preemptions"] == 0
    if "G" in layers or "M" in layers:
        return
    # W only (the prefix cache is on): a repeated prompt whose blocks are still cached (given
    # back, not yet evicted) takes them, and holds only its window's
    eng = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    assert eng.generate([prompts[0]], params)[0].outputs[0].token_ids == want[0]
    assert eng.generate([prompts[0]], params)[0].outputs[0].token_ids == want[0]
    assert eng.allocator.hits == 7  # the prompt's 7 full blocks (28 of its 29 tokens)


@pytest.mark.parametrize("layers", ["WWWA", "WAWA", "GWSA"])
def test_window_beside_full_attention_keeps_w_layers_in_rings(layers: str) -> None:
    """W beside A/S layers: the A/S layers page every token, the W layers keep a ring of
    R = ceil((8 + 5 − 1) / 4) + 1 = 4 blocks (16 tokens) a sequence in its state slot. Two
    40-token sequences (each wrapping its ring twice), chunked prefill of 8 tokens, then a pool
    too small for both (one is preempted and recomputed into a reused ring): the reference
    loop's greedy tokens every time. The shared pool holds the A/S layers' pages only."""
    kw = {"dsa_topk": 4, "dsa_index_dim": 8} if "S" in layers else {}
    model = _model(layers, **kw)
    prompts = [_prompt(29, 3), _prompt(23, 4)]
    want = [greedy_generate_reference(model, p, 40 - len(p)) for p in prompts]
    for num_blocks, preempted in ((64, False), (14, True)):
        eng = Engine(model, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=8)
        states = eng.runner.states
        n_paged, n_w = sum(c in "AS" for c in layers), layers.count("W")
        assert eng.window is None and not eng.allocator.enable_prefix_cache
        assert eng.cache.k.shape[0] == n_paged and states.ring_blocks == 4
        assert states.ring_k.shape == (n_w, (states.num_slots + 1) * 4, 4, 4, 16)
        assert "16-token ring per sequence" in eng.startup_line
        for p in prompts:
            params = SamplingParams(temperature=0, max_tokens=40 - len(p), ignore_eos=True)
            eng.add_request(p, params)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o.outputs[0].token_ids
        assert [outs[k] for k in sorted(outs)] == want
        assert (eng.stats["preemptions"] > 0) == preempted
        assert sorted(eng.scheduler.free_state_slots) == list(range(states.num_slots))
    # a sequence longer than the shared pool (the A/S layers need all its pages): one line
    eng = Engine(model, block_size=4, num_blocks=8, max_num_batched_tokens=8)
    with pytest.raises(LmforgeError, match="needs 10 KV blocks, the cache has 8"):
        eng.add_request(_prompt(29), SamplingParams(max_tokens=11))


@pytest.mark.parametrize("layers", ["GGGA", "MMMA", "LLAA", "WWWA", "GMWA"])
def test_reference_loop_left_padding(layers: str) -> None:
    """lmforge.generate's batch (left-padded, rows of different lengths, rows stopping early)
    equals each prompt alone and the no-cache full recompute: padding never enters a state."""
    model = _model(layers)
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 13, 9))]
    batch = generate(model, prompts, 7, temperature=0)
    for p, got in zip(prompts, batch, strict=True):
        assert got == greedy_generate_reference(model, p, 7)
    stop = batch[1][2]  # row 1 stops at its third token; the others go on beside its filler
    stopped = generate(model, prompts, 7, temperature=0, stop_tokens=[stop])
    for got, full in zip(stopped, batch, strict=True):
        assert got == full[: full.index(stop)] if stop in full else got == full


def test_state_slots_bound_admission_and_come_back() -> None:
    """Two state slots (max_num_seqs 2): five requests run two at a time, every slot is
    returned, an abort frees its slot, and the outputs match the reference."""
    model = _model("GMWA")
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 11, 3, 7, 9))]
    eng = Engine(model, block_size=4, num_blocks=64, max_num_seqs=2)
    assert isinstance(eng.runner.states, StatePool) and eng.runner.states.num_slots == 2
    outs = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == greedy_generate_reference(model, p, 8)
    assert sorted(eng.scheduler.free_state_slots) == [0, 1]
    rid = eng.add_request(prompts[0], GREEDY)
    eng.step()
    assert len(eng.scheduler.free_state_slots) == 1
    eng.abort(rid)
    assert sorted(eng.scheduler.free_state_slots) == [0, 1]


def test_n_samples_each_take_a_slot() -> None:
    """n = 3 samples of one request (no prefix cache to share the prompt through): each is
    prefilled in its own slot, and greedy samples all equal the reference."""
    model = _model("GMWA")
    prompt = _prompt(10)
    eng = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    (out,) = eng.generate([prompt], params)
    want = greedy_generate_reference(model, prompt, 6)
    assert [o.token_ids for o in out.outputs] == [want] * 3


def test_startup_line_states_memory() -> None:
    """KV bytes per token and state bytes per sequence (constant in its length)."""
    model = _model("GGGA")
    eng = Engine(model, block_size=4, num_blocks=64, max_num_seqs=3)
    per_seq = sum(b.attn.state_bytes(torch.float32) for b in model.layers if b.recurrent)
    assert eng.runner.states.bytes_per_slot() == per_seq
    # pages for the one A layer only: K and V, 4 kv-heads, head dim 16, fp32
    assert eng.cache.k.shape[0] == 1
    kv_per_token = 2 * 1 * 4 * 16 * 4
    assert f"KV {kv_per_token} B per token" in eng.startup_line
    assert f"recurrent state {per_seq} B per sequence (3 slots" in eng.startup_line


def test_sparse_layers_decode_and_speculative_recurrent_refused_in_one_line() -> None:
    """S layers serve (top-4 of prompts longer than 4) and decode in the reference loop, with
    or without speculative decoding; a recurrent model's speculative decoding stays refused."""
    from lmforge.serve.speculative import NgramDraft

    model = _model("SA", dsa_topk=4, dsa_index_dim=8)
    prompt = _prompt(13)
    want = greedy_generate_reference(model, prompt, 8)
    assert generate(model, [prompt], 8, temperature=0)[0] == want
    for spec in (None, NgramDraft()):
        eng = Engine(model, block_size=4, num_blocks=64, speculative=spec)
        assert eng.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    for layers in ("GA", "WA"):  # a recurrent state, a W ring: neither rolls back
        with pytest.raises(LmforgeError, match="per-sequence state of layers"):
            Engine(_model(layers), block_size=4, num_blocks=64, speculative=NgramDraft())


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["GGGA", "MMMA", "LLAA", "WWWA", "GMWA", "SASA", "GSWA"])
def test_hybrid_engine_on_cuda(layers: str) -> None:
    """On CUDA hybrids, DSA (S) layers included, decode through the compiled step inside CUDA
    graphs (the startup line says so): greedy tokens equal the reference loop's, log-probs
    within 1e-3 of the model's own forward (the chunked Triton kernels and TF32 dot products
    round differently)."""
    model = _model(layers, dsa_topk=4, dsa_index_dim=8).cuda()  # S: top-4 of up to 31 keys
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 13, 21, 6))]
    eng = Engine(model, block_size=16, num_blocks=64, max_num_seqs=8)
    assert eng.graphs is not None and eng.decoder is not None
    assert "compiled decode step on" in eng.startup_line
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == generate(model, [p], 10, temperature=0)[0]
        seq = p + o.outputs[0].token_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq], device="cuda"))[0].float(), -1)
        rows = torch.arange(len(p) - 1, len(seq) - 1)
        got = torch.tensor(o.outputs[0].logprobs)
        torch.testing.assert_close(got, lp[rows, o.outputs[0].token_ids].cpu(), atol=1e-3, rtol=0)


def test_ring_chunk_bounds_a_ring_to_about_two_windows() -> None:
    """With rings, one sequence computes at most max(window, 512) tokens a step (the budget
    allowing), so a ring holds window + that chunk, not window + the whole budget: window 600,
    budget 2048, 16-token blocks -> chunks of 600 and R = ceil(1199 / 16) + 1 = 76 blocks."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, context_length=2048, d_model=32, n_layers=2, n_heads=2,
                      layers="WA", window=600)  # fmt: skip
    eng = Engine(TransformerLM(cfg).eval(), block_size=16, num_blocks=256,
                 max_num_batched_tokens=2048, max_num_seqs=2)  # fmt: skip
    assert eng.runner.states.ring_blocks == 76 and eng.scheduler.max_seq_tokens == 600
    eng.add_request(_prompt(1500), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    (_seq, n), *_ = eng.scheduler.schedule()
    assert n == 600
