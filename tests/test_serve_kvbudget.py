"""KV-cache sizing from the memory measured after CUDA-graph capture: the arithmetic, the order
(capture against a probe cache, measure, size, capture again against the real cache), the one-
line refusal when not even one context fits, and the admission control that follows. The memory
probe is injected, so all of it runs on the CPU; the real path is a ``-m gpu`` test."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.model_runner import ModelRunner, PagedKVCache, kv_blocks_for_memory
from lmforge.utils import LmforgeError

V = 97


def _model() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V, context_length=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


def _per_block(model: TransformerLM, bs: int) -> int:
    return PagedKVCache.bytes_per_block(model, bs, torch.float32)


def test_kv_blocks_for_memory_arithmetic() -> None:
    assert kv_blocks_for_memory(10_000, 0.8, 0, 100) == 80
    assert kv_blocks_for_memory(10_000, 0.8, 1_050, 100) == 69  # (8000 - 1050) // 100
    assert kv_blocks_for_memory(1_000, 0.5, 900, 100) == 0  # reserve above the budget: none
    with pytest.raises(LmforgeError, match="kv_memory_fraction must be in"):
        kv_blocks_for_memory(1_000, 1.5, 0, 100)


class _FakeMemory:
    """Free device bytes as a counter that fake graph captures draw from."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.reads: list[int] = []

    def __call__(self) -> int:
        self.reads.append(self.free)
        return self.free


def test_cache_is_sized_after_capture_then_graphs_are_recaptured(monkeypatch) -> None:
    model = _model()
    per_block = _per_block(model, 8)
    mem = _FakeMemory(1_000 * per_block)
    pool = 150 * per_block  # what the (fake) graph capture takes
    captured: list[int] = []

    class FakeGraphs:
        def __init__(self, engine: ModelRunner) -> None:
            captured.append(engine.cache.num_blocks)
            mem.free -= pool
            self.graphs = {1: object()}
            self.closed = False

        def close(self) -> None:
            mem.free += pool
            self.closed = True

        def run(self, batch):  # replay: None = run this step eagerly
            return None

    monkeypatch.setattr(ModelRunner, "_graphs_supported", lambda self: True)
    monkeypatch.setattr(ModelRunner, "_make_graphs", lambda self: FakeGraphs(self))
    engine = Engine(
        model, block_size=8, cuda_graphs=True, memory_probe=mem, kv_memory_fraction=0.5,
        max_num_batched_tokens=32,
    )  # fmt: skip
    probe_blocks = captured[0]
    assert probe_blocks == math.ceil(32 / 8) + 1 + 2 + 1  # budget + 1 sequence + slack + scratch
    # Read after the capture: the pool is excluded, the probe cache (freed later) counted back.
    assert mem.reads[-1] == 1_000 * per_block - pool
    want = ((1_000 - 150 + probe_blocks) * per_block // 2) // per_block
    assert engine.allocator.num_blocks == want == engine.kv_budget["num_blocks"]
    assert engine.cache.num_blocks == want + 1  # + the scratch block for graph padding
    # Graphs captured a second time, against the final cache; the probe's were released.
    assert captured == [probe_blocks, want + 1]
    assert isinstance(engine.graphs, FakeGraphs) and not engine.graphs.closed
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.outputs[0].token_ids == generate(model, [[1, 2, 3]], 5, temperature=0)[0]


def test_too_little_memory_for_one_context_is_one_line() -> None:
    model = _model()
    with pytest.raises(LmforgeError, match=r"leave room for 3 blocks of 8; one 64-token context"):
        # the probe cache (2 + 1 + 2 + scratch = 6 blocks) counted back, nothing else: 3 < 8
        Engine(model, block_size=8, max_num_batched_tokens=16, memory_probe=lambda: 0,
               kv_memory_fraction=0.5)  # fmt: skip


def test_admission_control_follows_the_measured_budget() -> None:
    """A measured budget of 16 blocks: four requests needing 8 blocks each never run all at once
    and never hold more than 16 blocks, and every output equals its solo greedy run."""
    model = _model()
    bs = 4
    per_block = _per_block(model, bs)
    probe_bytes = (math.ceil(16 / bs) + 1 + 2 + 1) * per_block  # budget 16 tokens, as below
    engine = Engine(
        model, block_size=bs, max_num_batched_tokens=16, kv_memory_fraction=1.0,
        memory_probe=lambda: 16 * per_block - probe_bytes, enable_prefix_cache=False,
    )  # fmt: skip
    assert engine.allocator.num_blocks == 16  # exactly one full 64-token context
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (20,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12)  # 32 tokens = 8 blocks each
    for p in prompts:
        engine.add_request(p, params)
    most, done = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(engine.running))
        assert engine.allocator.num_used <= 16
    # The budget binds: never all four at once (blocks are taken chunk by chunk, so a third
    # may start its prefill, and one may be preempted and recomputed later), never an overrun.
    assert most < 4
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    assert [done[f"req-{i}"] for i in range(4)] == want
    assert engine.allocator.num_used == 0


@pytest.mark.gpu
def test_gpu_kv_budget_measured_after_graph_capture() -> None:
    """On CUDA: the real probe (cudaMemGetInfo) after capture, the cache sized from it, the
    graphs recaptured against the real cache (greedy equals generate), memory left over."""
    model = _model().cuda()
    engine = Engine(
        model, block_size=8, cuda_graphs=True, compile=False, max_num_seqs=8,
        kv_memory_fraction=0.05,
    )  # fmt: skip
    b = engine.kv_budget
    assert b is not None and b["free_after_capture"] <= b["free_before_capture"]
    assert engine.graphs is not None and engine.graphs.graphs
    kv_bytes = engine.allocator.num_blocks * b["bytes_per_block"]
    assert kv_bytes <= 0.05 * (b["free_after_capture"] + b["probe_bytes"])
    free_now = torch.cuda.mem_get_info()[0]
    assert free_now >= 0.9 * b["free_after_capture"] - kv_bytes
    prompts = [[1, 2, 3], list(range(1, 40)), [5] * 17]
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.allocator.num_used == 0
