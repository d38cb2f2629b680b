"""The engine's per-step host fast paths against their slow references: step inputs packed into
two tensors (views) equal the per-field tensors, the one-temperature scalar path of the
sampler's logprobs equals the per-row one, and (GPU) the pinned asynchronous input copies stay
correct across steps that do not synchronise (every sequence mid-prefill)."""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.sampling import _effective_temperature, logprobs_of

V = 97


def _model() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


def test_packed_step_inputs_equal_the_per_field_tensors() -> None:
    engine = Engine(_model(), block_size=4, max_num_batched_tokens=12)
    g = torch.Generator().manual_seed(1)
    for n in (3, 9, 14):
        engine.add_request(torch.randint(0, V, (n,), generator=g).tolist(), SamplingParams())
    packed = engine._batch
    seen = {"mixed": 0, "decode": 0}

    def checked(chosen):  # the reference: one tensor per field, as the engine built them
        batch = packed(chosen)
        bs = engine.block_size
        toks, pos, slots, rows = [], [], [], []
        for seq, n in chosen:
            for p in range(seq.n_cached, seq.n_cached + n):
                toks.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
            rows.append(len(toks) - 1)
        width = max(len(s.blocks) for s, _ in chosen)
        tables = [list(s.blocks) + [0] * (width - len(s.blocks)) for s, _ in chosen]
        ctx = [s.n_cached + n for s, n in chosen]
        assert torch.equal(batch.tokens, torch.tensor(toks))
        assert torch.equal(batch.positions, torch.tensor(pos))
        assert torch.equal(batch.slots, torch.tensor(slots))
        assert torch.equal(batch.last_rows, torch.tensor(rows))
        assert torch.equal(batch.block_tables, torch.tensor(tables, dtype=torch.int32))
        assert torch.equal(batch.ctx_lens, torch.tensor(ctx, dtype=torch.int32))
        assert batch.tokens.dtype == torch.long and batch.block_tables.dtype == torch.int32
        seen["decode" if batch.decode_only else "mixed"] += 1
        return batch

    engine._batch = checked
    while engine.has_unfinished():
        engine.step()
    assert seen["mixed"] >= 2 and seen["decode"] >= 2  # chunked prefill + decode both checked


def test_stage_copies_array_tables_and_snapshots_them() -> None:
    """Block tables arrive as the scheduler's C arrays (ragged: padded with block 0); the staged
    tensors and host lists equal the lists' and later appends to the arrays do not reach them."""
    from array import array

    from lmforge.serve.scheduler import StepInputs
    from lmforge.serve.step import stage

    tables = [array("i", [5, 9, 2]), array("i", [7]), array("i", range(20, 26))]
    inp = StepInputs(tokens=[1, 2, 3], positions=[40, 3, 90], slots=[11, 29, 101],
                     last_rows=[0, 1, 2], q_lens=[1, 1, 1], ctx_lens=[41, 4, 91],
                     tables=tables)  # fmt: skip
    batch = stage(inp, torch.device("cpu"))
    want = [[5, 9, 2, 0, 0, 0], [7, 0, 0, 0, 0, 0], list(range(20, 26))]
    assert torch.equal(batch.block_tables, torch.tensor(want, dtype=torch.int32))
    assert batch.slots.tolist() == [11, 29, 101] and batch.ctx_lens.tolist() == [41, 4, 91]
    tables[0].append(99)  # the scheduler grows a table after the step was staged
    assert list(batch.tables_list[0]) == [5, 9, 2] and batch.block_tables.shape == (3, 6)


@pytest.mark.parametrize("temps", [(0.7, 0.7, 0.7), (0.0, 0.0), (1.0,), (0.5, 1.3, 0.0)])
def test_scalar_temperature_path_equals_per_row(temps: tuple[float, ...]) -> None:
    logits = torch.randn(len(temps), V, generator=torch.Generator().manual_seed(2)) * 4
    params = [SamplingParams(temperature=t) for t in temps]
    want = torch.log_softmax(logits / _effective_temperature(params, logits.device)[:, None], -1)
    torch.testing.assert_close(logprobs_of(logits, params), want, rtol=0, atol=1e-6)


def test_mixed_temperatures_in_one_batch_match_each_alone() -> None:
    model = _model()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ps = [SamplingParams(temperature=t, seed=7, max_tokens=6) for t in (0.0, 0.6, 1.4)]
    crowd = Engine(model).generate([prompt] * 3, ps)
    for p, out in zip(ps, crowd, strict=True):
        alone = Engine(model).generate([prompt], p)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(out.outputs[0].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_pinned_inputs_across_prefill_only_steps(graphs: bool) -> None:
    """A small token budget makes several steps pure prefill chunks (no token read back, no
    sync): the pinned staging buffers must not be overwritten under an in-flight copy."""
    model = _model().cuda()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (60, 45, 7, 90)]
    want = [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    engine = Engine(model, block_size=8, num_blocks=128, max_num_batched_tokens=16,
                    cuda_graphs=graphs, compile=False, max_num_seqs=4)  # fmt: skip
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.allocator.num_used == 0
