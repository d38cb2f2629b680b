"""CUDA graphs for decode steps at bucketed batch sizes, with an eager fallback.

A decode step (eager, or compiled: :mod:`lmforge.serve.compiled`) is many small kernels whose launch cost (CPU) exceeds their run time at
small batches. Each bucket size B (1, 2, 4, 8, 16, 32, …, up to ``max_num_seqs``, or the runner's
``decode_rows`` when larger: a speculative verify's k + 1 rows at batch 1) gets one graph
of :func:`~lmforge.serve.model_runner.forward_step` captured over static input tensors; a step with b ≤ B
sequences copies its inputs into the first b rows and pads the rest with a dummy sequence whose
one token is written to a scratch block outside the allocator's range (so padding never touches
real KV). Block tables are padded to the context's full width; the kernel reads only
``ctx_lens`` worth of each row. Steps that do not fit (mixed prefill, more sequences than the
largest bucket) run eagerly. If capture fails, one line on stderr says so and the engine stays
eager.

Every model the engine serves on the device only is captured the same way: GQA, MLA (its
latent cache is the one cache tensor the step writes) and hybrids. A hybrid's step also reads
its sequences' recurrent-state slots from a static buffer (padding rows take the pool's
scratch slot, zeroed before such a replay so it never accumulates); the slots of sequences
starting at token 0 (a one-token prompt's first step is decode-only) are zeroed before the
replay, outside the graph.

Exercised by ``pytest -m gpu tests/test_serve_engine.py`` and ``benchmarks/serve.py``.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import TYPE_CHECKING

import torch

from lmforge.serve.step import StepBatch

if TYPE_CHECKING:
    from lmforge.serve.model_runner import ModelRunner

__all__ = ["DecodeGraphs", "StepReplay", "bucket_sizes"]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 32, then of 32 (as vLLM buckets), capped."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *list(range(64, 513, 32))]
    out = [b for b in sizes if b < max_batch] + [max_batch]
    return sorted(set(out))


class StepReplay:
    """What stands in for a captured graph off CUDA (``DecodeGraphs(emulate=True)``: tests on
    the CPU): ``replay()`` reruns the decode step on the same static input buffers and copies
    its logits into the same output tensor, so the staging, padding and state-slot logic around
    a replay is exercised as on CUDA."""

    def __init__(self, runner: ModelRunner, batch: StepBatch, out: torch.Tensor) -> None:
        self.runner, self.batch, self.out = runner, batch, out  # DecodeGraphs' proxy

    def replay(self) -> None:
        """Run the step again on the static buffers; the logits go to the captured output."""
        self.out.copy_(self.runner.decode_step(self.batch))


class DecodeGraphs:
    """Captured decode graphs for one engine (see the module docstring). ``emulate``: no CUDA
    graph, a :class:`StepReplay` per bucket (the CPU tests of everything around a replay)."""

    def __init__(
        self, runner: ModelRunner, max_batch: int | None = None, emulate: bool = False
    ) -> None:
        # the runner owns the graphs: a proxy, so a dropped engine frees its KV cache and graph
        # pool at once, not at the next cyclic garbage collection (which device memory never
        # triggers: the next engine of a process ran out of memory)
        self.runner = weakref.proxy(runner)
        self.emulate = emulate
        cache = runner.cache
        dev = runner.device
        self.scratch = cache.num_blocks - 1  # the cache holds one block the allocator never gives
        self.width = math.ceil(runner.config.context_length / runner.block_size)
        self.sizes = bucket_sizes(min(max_batch or runner.decode_rows, 512))
        top = self.sizes[-1]
        bs = runner.block_size
        self.tokens = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), self.scratch * bs, dtype=torch.long, device=dev)
        self.tables = torch.full((top, self.width), self.scratch, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(top, dtype=torch.int32, device=dev)
        # Every tensor a graph reads must outlive it: the rows too, not a per-capture arange.
        self.rows = torch.arange(top, device=dev)
        states = runner.states  # a hybrid's recurrent-state pool, or None
        self.state_scratch = None if states is None else states.scratch_slot
        self.state_slots = None
        self._scratch_slot = None
        if states is not None:
            self.state_slots = torch.full((top,), states.scratch_slot, dtype=torch.long,
                                          device=dev)  # fmt: skip
            self._scratch_slot = self.state_slots[:1].clone()
        self.graphs: dict[int, torch.cuda.CUDAGraph | StepReplay] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        try:
            self._capture()
        except Exception as e:  # any capture failure: eager decode, said once
            print(
                f"lmforge serve: CUDA graph capture failed, decoding eagerly ({e})", file=sys.stderr
            )
            self.close()

    def close(self) -> None:
        """Drop the graphs and their outputs (their memory pool goes back to the allocator)."""
        self.graphs.clear()
        self.outputs.clear()

    def _batch(self, b: int) -> StepBatch:
        slots = None if self.state_slots is None else self.state_slots[:b]
        return StepBatch(
            tokens=self.tokens[:b],
            positions=self.positions[:b],
            slots=self.slots[:b],
            block_tables=self.tables[:b],
            ctx_lens=self.ctx[:b],
            last_rows=self.rows[:b],
            q_lens=[1] * b,
            ctx_lens_list=[1] * b,
            tables_list=[[self.scratch]] * b,
            state_slots=slots,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        if self.emulate:
            for b in reversed(self.sizes):
                batch = self._batch(b)
                self.graphs[b] = StepReplay(self.runner, batch, self.runner.decode_step(batch))
                self.outputs[b] = self.graphs[b].out
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            batch = self._batch(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (compile, Triton autotuning, lazy init)
                    self.runner.decode_step(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.runner.decode_step(batch)
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits (b, V) of a decode-only step by graph replay, or None (run it eagerly)."""
        b = len(batch.q_lens)
        size = next((s for s in self.sizes if s >= b), None)
        if size is None or size not in self.graphs or batch.block_tables.shape[1] > self.width:
            return None
        w = batch.block_tables.shape[1]
        self.tokens[:b].copy_(batch.tokens)
        self.positions[:b].copy_(batch.positions)
        self.slots[:b].copy_(batch.slots)
        self.tables[:b, :w].copy_(batch.block_tables)
        self.ctx[:b].copy_(batch.ctx_lens)
        states = self.runner.states
        if states is not None:
            self.state_slots[:b].copy_(batch.state_slots)
            if batch.state_fresh is not None:  # sequences starting at token 0
                states.reset(batch.state_fresh)
        if size > b:  # padding rows: the dummy sequence in the scratch block (and state slot)
            self.tokens[b:size].zero_()
            self.positions[b:size].zero_()
            self.slots[b:size].fill_(self.scratch * self.runner.block_size)
            self.tables[b:size].fill_(self.scratch)
            self.ctx[b:size].fill_(1)
            if states is not None:
                self.state_slots[b:size].fill_(self.state_scratch)
                states.reset(self._scratch_slot)
        self.graphs[size].replay()
        return self.outputs[size][:b]
