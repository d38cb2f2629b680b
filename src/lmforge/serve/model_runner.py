"""The model runner: the KV cache's memory, the compiled decode step, CUDA graphs, staging.

What turns the :class:`~lmforge.serve.scheduler.Scheduler`'s decision into logits: the host
lists of a step are staged to the device (:meth:`ModelRunner.prepare`: two tensors, pinned
buffers and asynchronous copies on CUDA) and run through the model's own forward
(:meth:`ModelRunner.run`): decode-only steps by CUDA-graph replay where captured, else the
compiled decode step (:mod:`lmforge.serve.compiled`), else eagerly (:func:`forward_step`); steps
with prefill through the compiled prefill step for full-attention models (one dynamic graph,
:meth:`~lmforge.serve.compiled.CompiledDecode.mixed`), eagerly for the others. There is no forward here: :func:`forward_step` builds the model's per-step
:class:`~lmforge.model.context.Context` (positions, slots, block tables, lengths, the kernels of
:mod:`lmforge.serve.attention`) and calls ``TransformerLM.forward``, which runs every model switch
(muP, QK-norm, soft-cap, tied head, GQA, RoPE scaling, MoE) the way training does; the step's
tokens of all sequences are one flat (1, N) batch (no padding). GQA, MLA (latent cache, CLA)
and hybrid patterns (A, W, G, M, L: the recurrent states in :attr:`ModelRunner.states`, one
slot per running sequence plus a scratch slot for graph padding) all take the compiled step and
CUDA graphs; :meth:`ModelRunner._host_reads` names what stays eager (fp32/fp16 MoE experts on
CUDA, DSA layers).

KV memory: ``num_blocks`` blocks, by default (CUDA, or any device given a ``memory_probe``) a
fraction of the free device memory measured *after* the weights, the compiled decode step and
the CUDA-graph capture, minus the measured peak of the largest eager step
(:meth:`ModelRunner._size_after_capture` says how: capture against a probe cache, measure,
size, recapture); on the CPU without a probe, 16 contexts capped at 1 GiB. The cache holds one
block more than the allocator hands out: CUDA-graph padding rows write there. A block's bytes
are those of every K/V layer (linear layers G/M/L have none) plus, for DSA layers (S), their
E_I-wide indexer keys (:func:`kv_bytes_per_block`).

Shape legend: N tokens in the step, S sequences, V vocab, M block-table width.
Exercised by ``pytest tests/test_serve_engine.py tests/test_serve_kvbudget.py
tests/test_serve_hostpath.py tests/test_serve_compiled_hybrid.py``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmforge.model.cla import kv_cache_layers
from lmforge.model.context import PagedKVCache
from lmforge.model.kv_cache import paged_kv_layers, window_ring
from lmforge.model.linear_attention import StatePool
from lmforge.model.mla import PagedLatentCache
from lmforge.serve.scheduler import StepInputs
from lmforge.serve.step import StepBatch, forward_step, stage
from lmforge.utils.errors import LmforgeError

__all__ = [
    "ModelRunner",
    "PagedKVCache",
    "StepBatch",
    "forward_step",
    "kv_blocks_for_memory",
    "kv_bytes_per_block",
    "new_kv_cache",
    "ring_chunk",
    "stage",
]


def new_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
) -> PagedKVCache | PagedLatentCache:
    """The paged cache ``model``'s attention needs: keys and values of every K/V layer (GQA),
    or one (C + R)-wide latent per token of every such layer (MLA); with cross-layer sharing
    every k only the ceil(L / k) producing layers (:mod:`lmforge.model.cla`)."""
    cfg = model.config
    if cfg.attention_type == "mla":
        layers = kv_cache_layers(cfg.n_layers, cfg.kv_share_every)
        return PagedLatentCache(layers, num_blocks, block_size, cfg.mla.latent_dim, device, dtype)
    # pages for K/V layers only: a hybrid's linear layers keep recurrent states (StatePool)
    n_sparse = cfg.layer_types.count("S")  # DSA layers also page their indexer keys
    if n_sparse and dtype in (torch.float8_e4m3fn, torch.int8):
        raise LmforgeError(
            f"sparse-attention (S) layers {cfg.layers!r} read their pages in the torch path, "
            "which has no quantized KV cache: serve with --kv-cache-dtype auto"
        )
    return PagedKVCache(
        _kv_layers(cfg), num_blocks, block_size, cfg.kv_heads, cfg.head_dim, device, dtype,
        index_layers=n_sparse, index_dim=cfg.dsa_index_dim if n_sparse else 0,
    )  # fmt: skip


def _kv_layers(cfg: Any) -> int:
    """Page layers of a GQA model's K/V: its attention layers (no linear ones), and with
    cross-layer sharing every k (full attention only) the ceil(L / k) producing ones."""
    return kv_cache_layers(paged_kv_layers(cfg.layer_types), cfg.kv_share_every)


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of :func:`new_kv_cache`'s cache takes across all its layers (an S
    layer's indexer keys, E_I per token, included)."""
    cfg = model.config
    if cfg.attention_type == "mla":
        layers = kv_cache_layers(cfg.n_layers, cfg.kv_share_every)
        return PagedLatentCache.bytes_per_block(layers, block_size, cfg.mla.latent_dim, dtype)
    per_layer = PagedKVCache.bytes_per_block(model, block_size, dtype) // cfg.n_layers
    index = cfg.layer_types.count("S") * block_size * cfg.dsa_index_dim  # DSA indexer keys
    return per_layer * _kv_layers(cfg) + index * dtype.itemsize


class ModelRunner:
    """The model, its paged KV cache and the decode fast paths on one device.

    ``num_blocks``: blocks the scheduler may hand out (None: sized from memory, see the module
    docstring; the result is :attr:`num_blocks`). ``cuda_graphs`` / ``compile`` None: on for
    CUDA, off on the CPU. ``max_decode_rows``: the most one-token rows a decode step may carry
    when that exceeds ``max_num_seqs`` (a speculative verify: k + 1 rows of one sequence,
    :func:`~lmforge.serve.step.as_decode_rows`); the CUDA graphs' buckets cover it, so the
    verify replays a graph like a plain decode step instead of launching every kernel."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_dtype: torch.dtype | None = None,
        use_triton: bool | None = None,
        num_blocks: int | None = None,
        kv_memory_fraction: float = 0.8,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        compile_prefill: bool | None = None,
        memory_probe: Callable[[], int] | None = None,
        max_decode_rows: int | None = None,
    ) -> None:
        self.model = model
        self.compile_prefill = compile_prefill is not False  # with the compiled decode step
        self.config = model.config
        self.device = device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.decode_rows = max(max_num_seqs, max_decode_rows or 0)
        "the largest decode step (rows) the CUDA graphs are captured for"
        self.max_num_batched_tokens = max_num_batched_tokens
        self.use_triton = use_triton
        dtype = kv_dtype or next(model.parameters()).dtype
        self.kv_dtype = dtype
        self.kv_budget: dict[str, float] | None = None  # how the cache was sized from memory
        self._stage: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stage_done: torch.cuda.Event | None = None
        probe = memory_probe
        if probe is None and device.type == "cuda":

            def probe() -> int:
                return int(torch.cuda.mem_get_info(device)[0])

        # the measured-best path is the default: CUDA graphs and the compiled step on CUDA
        self.use_graphs = (cuda_graphs is not False) and self._graphs_supported()
        want_compile = compile if compile is not None else device.type == "cuda"
        weights = next(model.parameters()).dtype  # the experts' dtype, whatever the KV's
        quantized_kv = dtype in (torch.float8_e4m3fn, torch.int8)
        compute = weights if quantized_kv else dtype  # what the linear layers' states hold
        self.states = new_state_pool(
            model, max_num_seqs, device, compute, block_size=block_size,
            chunk=max_num_batched_tokens,
        )  # fmt: skip
        self.host_reads = self._host_reads(compute)
        if self.host_reads:  # a step that reads the device on the host can be neither
            self.use_graphs = want_compile = False
        if num_blocks is None and probe is not None:
            num_blocks = self._size_after_capture(
                probe, kv_memory_fraction, self.use_graphs, want_compile
            )
        else:
            if num_blocks is None:
                num_blocks = self._default_num_blocks(dtype)
            self._build(num_blocks, self.use_graphs, want_compile)
        self.num_blocks = num_blocks

    def describe(self) -> str:
        """What was chosen, as part of one line."""
        dec = self.decoder
        graphs = self.graphs is not None and bool(self.graphs.graphs)
        parts = [
            f"engine on {self.device.type}",
            f"CUDA graphs {'on' if graphs else 'off'}"
            + (" (capture failed)" if self.use_graphs and not graphs else ""),
            f"compiled decode step {'on' if dec is not None and dec.failed is None else 'off'}",
            "compiled prefill step "
            + ("on" if dec is not None and dec.mixed_on and dec.mixed_failed is None else "off"),
        ]
        if dec is not None:
            parts.append(f"decode GEMV {'on' if dec.gemv is not None else 'off'}")
        if self.host_reads:
            parts.append(f"eager because {self.host_reads}")
        parts.append(f"KV cache {self.num_blocks} blocks of {self.block_size} tokens")
        return ", ".join(parts)

    def _graphs_supported(self) -> bool:
        return self.device.type == "cuda"

    def _host_reads(self, dtype: torch.dtype) -> str | None:
        """Why a decode step must stay eager (it reads device values on the host), or None.

        MoE experts outside bf16 on CUDA run the readable per-expert loop, which reads the
        expert counts on the host (``torch._grouped_mm`` is bf16 only): no CUDA graph can
        capture that and the compiled step would break its graph at every MoE layer. MLA
        (latent cache, CLA), hybrid layers (A, W, G, M, L) and DSA layers (S) decode on the
        device only (:mod:`lmforge.serve.compiled`: latent, window and slot-state custom ops; an
        S layer's batched top-k selection over its indexer-key pages is plain tensor code).
        Prefill steps (eager) of S layers loop over their sequences on the host lists."""
        moe = any(self.config.moe.is_moe_layer(i) for i in range(self.config.n_layers))
        if moe and self.device.type == "cuda" and dtype != torch.bfloat16:
            return f"MoE experts in {str(dtype).removeprefix('torch.')} read counts on the host"
        return None

    def _new_cache(self, n: int) -> PagedKVCache | PagedLatentCache:
        return new_kv_cache(self.model, n, self.block_size, self.device, self.kv_dtype)

    def _build(
        self, n: int, use_graphs: bool, want_compile: bool, probe: Callable[[], int] | None = None
    ) -> int | None:
        """A cache of ``n`` blocks (+ the scratch block), the compiled step, then the CUDA graphs
        (or, without graphs, the compiled step warmed up); ``probe()`` read before the capture."""
        self.cache = self._new_cache(n + 1)
        self.decoder = self._make_decoder(want_compile)
        free = probe() if probe is not None else None
        self.graphs = self._make_graphs() if use_graphs else None
        if self.decoder is not None:
            if self.graphs is None:
                self.decoder.warmup(self.cache.num_blocks - 1, self.block_size)
            self.decoder.warmup_mixed(self.cache.num_blocks - 1, self.block_size)
        return free

    def _make_decoder(self, want: bool) -> Any:
        # Decode steps through torch.compile (lmforge.serve.compiled); default on for CUDA.
        if not want:
            return None
        from lmforge.serve.compiled import CompiledDecode

        return CompiledDecode(
            self.model, self.cache, self.use_triton, states=self.states, mixed=self.compile_prefill
        )

    def _make_graphs(self) -> Any:
        from lmforge.serve.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self)  # compiles while warming up each bucket

    def _default_num_blocks(self, dtype: torch.dtype) -> int:
        """CPU without a memory probe: 16 full contexts, at most 1 GiB (at least one context)."""
        per_block = kv_bytes_per_block(self.model, self.block_size, dtype)
        blocks_per_seq = math.ceil(self.config.context_length / self.block_size)
        return max(
            blocks_per_seq, min(blocks_per_seq * min(self.max_num_seqs, 16), (1 << 30) // per_block)
        )

    def _size_after_capture(
        self, probe: Callable[[], int], fraction: float, use_graphs: bool, want_compile: bool
    ) -> int:
        """Size the KV cache from the memory left once everything else exists; returns blocks.

        1. A probe cache just big enough for one step's token budget stands in for the real
           one; the decode step is compiled and the CUDA graphs are captured against it (their
           memory pool does not depend on the number of blocks: tables have a fixed width).
        2. On CUDA, one prefill step of the whole token budget runs on the probe cache; its
           peak allocation (plus the sampler's (S, V) float32 temporaries at ``max_num_seqs``)
           is kept back for the eager steps to come. Cached allocator blocks are released.
        3. ``probe()`` reads the free device memory now, after weights, graphs and compile.
           The KV budget is ``fraction`` of it minus that reserve (:func:`kv_blocks_for_memory`).
        4. The probe cache and its graphs are dropped, the real cache is allocated and the
           graphs are captured again against it (compile is not repeated: the block count is a
           dynamic dimension of the compiled step).

        Fewer blocks than one full context raise one line (admission control could never
        admit a full-length request). ``probe`` is injectable (``Engine(memory_probe=)``) so the
        arithmetic and the admission control after it are testable without a GPU.
        """
        per_block = kv_bytes_per_block(self.model, self.block_size, self.kv_dtype)
        blocks_per_seq = math.ceil(self.config.context_length / self.block_size)
        n_seqs = math.ceil(self.max_num_batched_tokens / max(self.config.context_length - 1, 1))
        n_probe = math.ceil(self.max_num_batched_tokens / self.block_size) + n_seqs + 2
        free_before = self._build(n_probe, use_graphs, want_compile, probe)
        reserve = self._profile_step_memory(n_probe) if self.device.type == "cuda" else 0
        free_after = probe()
        probe_bytes = self.cache.num_blocks * per_block
        blocks = kv_blocks_for_memory(free_after + probe_bytes, fraction, reserve, per_block)
        self.kv_budget = {
            "free_before_capture": free_before,
            "free_after_capture": free_after,
            "activation_reserve": reserve,
            "fraction": fraction,
            "bytes_per_block": per_block,
            "probe_bytes": probe_bytes,
            "num_blocks": blocks,
        }
        if blocks < blocks_per_seq:
            gib = free_after / 2**30
            raise LmforgeError(
                f"KV cache: {gib:.2f} GiB free after the weights and CUDA graphs leave room for "
                f"{blocks} blocks of {self.block_size}; one {self.config.context_length}-token "
                "context needs "
                f"{blocks_per_seq} (lower --context-length or the token budget, or free memory)"
            )
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        self.cache = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.cache = self._new_cache(blocks + 1)
        if self.decoder is not None:
            self.decoder.cache = self.cache
        if use_graphs:
            self.graphs = self._make_graphs()
        return blocks

    @torch.inference_mode()
    def _profile_step_memory(self, n_probe: int) -> int:
        """Peak bytes one eager prefill step of the whole token budget allocates (CUDA), plus
        the sampler's temporaries; run on the probe cache, nothing is registered anywhere."""
        dev = self.device
        ctx, bs = self.config.context_length, self.block_size
        lens, left = [], self.max_num_batched_tokens
        while left > 0:
            lens.append(min(left, ctx - 1))
            left -= lens[-1]
        step = StepInputs([], [], [], [], lens, lens, [])
        block = 0
        for n in lens:
            table = list(range(block, block + math.ceil(n / bs)))
            block += len(table)
            step.tables.append(table)
            if self.states is not None:  # hybrids: the probe's sequences take slots 0, 1, …
                step.state_slots.append(len(step.state_slots) % self.states.num_slots)
            step.tokens += [0] * n
            step.positions += range(n)
            step.slots += [table[p // bs] * bs + p % bs for p in range(n)]
            step.last_rows.append(len(step.tokens) - 1)
        assert block <= n_probe
        batch = self.prepare(step)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        forward_step(self.model, self.cache, batch, use_triton=self.use_triton, states=self.states)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del batch
        torch.cuda.empty_cache()
        # log_softmax, probabilities, exponential noise, their ratio, a float copy: (S, V) fp32.
        sampler = 6 * self.max_num_seqs * self.config.vocab_size * 4
        return int(peak + sampler)

    def prepare(self, inputs: StepInputs) -> StepBatch:
        """The step's inputs on the device (:func:`stage`, through pinned buffers on CUDA)."""
        return stage(inputs, self.device, self._to_device)

    def _to_device(self, longs: array, ints: array) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's int64 and int32 inputs on the device. On CUDA through persistent pinned
        staging buffers (grown as needed) with asynchronous copies; an event recorded after
        the copies is waited on before the buffers are refilled (a step whose sequences are
        all mid-prefill reads nothing back, so it does not synchronise by itself)."""
        a = torch.frombuffer(longs, dtype=torch.long)  # views of the C arrays (no conversion)
        b = torch.frombuffer(ints, dtype=torch.int32)
        if self.device.type != "cuda":
            return a, b
        stage = self._stage
        if stage is None or stage[0].numel() < a.numel() or stage[1].numel() < b.numel():
            stage = (
                torch.empty(max(2 * a.numel(), 1024), dtype=torch.long, pin_memory=True),
                torch.empty(max(2 * b.numel(), 1024), dtype=torch.int32, pin_memory=True),
            )
            self._stage = stage
        done = self._stage_done
        if done is not None:
            done.synchronize()  # the previous step's copies have read the buffers
        sa, sb = stage[0][: a.numel()], stage[1][: b.numel()]
        sa.copy_(a)
        sb.copy_(b)
        out = sa.to(self.device, non_blocking=True), sb.to(self.device, non_blocking=True)
        self._stage_done = torch.cuda.Event()
        self._stage_done.record()
        return out

    def decode_step(self, batch: StepBatch) -> torch.Tensor:
        """Logits (S, V) of a decode-only batch: compiled if enabled, else eager (no graphs)."""
        if self.decoder is not None:
            return self.decoder(batch)
        return forward_step(
            self.model, self.cache, batch, use_triton=self.use_triton, states=self.states
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits (S, V) float32 of the rows ``batch.last_rows``: graph replay, else the
        compiled step for decode-only steps; the compiled prefill step for other steps of
        full-attention models (:meth:`CompiledDecode.mixed`); the model's eager forward
        otherwise."""
        if batch.decode_only and batch.image_rows is None:
            if self.graphs is not None:
                logits = self.graphs.run(batch)
                if logits is not None:
                    return logits
            return self.decode_step(batch)
        if self.decoder is not None and self.decoder.mixed_ok(batch):
            return self.decoder.mixed(batch)
        return forward_step(
            self.model, self.cache, batch, use_triton=self.use_triton, states=self.states
        )


def ring_chunk(window: int, budget: int) -> int:
    """The most tokens one sequence computes in a step when W layers keep rings: the step's
    token budget, but no more than max(window, 512), so a ring (window + this chunk) stays
    about two windows long however large the budget; chunks never drop below 512 tokens."""
    return min(budget, max(window, 512))


def new_state_pool(
    model: nn.Module,
    num_slots: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    block_size: int = 16,
    chunk: int = 2048,
) -> StatePool | None:
    """The recurrent states of ``model``'s linear layers (G, M, L) and, where W layers sit
    beside A/S layers, the W layers' rings: R = ceil((``chunk`` + window − 1) / BS) + 1 blocks
    a sequence (``chunk``: the most tokens of one sequence in a step), or the whole context's
    blocks where that is fewer. ``num_slots`` sequences (one slot per running sequence, so
    ``max_num_seqs``; with rings on CUDA, at most what half the free memory holds: a ring is
    reserved per slot, used or not); None for a model with neither."""
    cfg = model.config
    mixers = {i: b.attn for i, b in enumerate(model.layers) if getattr(b, "recurrent", False)}
    ring = None
    if window_ring(cfg.layer_types):
        whole = math.ceil(cfg.context_length / block_size)  # no position ever wraps
        chunk = ring_chunk(cfg.window, chunk)  # what the scheduler lets one sequence compute
        blocks = min(math.ceil((chunk + cfg.window - 1) / block_size) + 1, whole)
        n_w = cfg.layer_types.count("W")
        ring = (n_w, blocks, block_size, cfg.kv_heads, int(cfg.head_dim))
        per_slot = 2 * n_w * blocks * block_size * cfg.kv_heads * int(cfg.head_dim) * dtype.itemsize
        if device.type == "cuda":  # rings are reserved per slot: at most half the free memory
            fit = int(torch.cuda.mem_get_info(device)[0] // 2 // per_slot) - 1  # (+ scratch)
            if fit < 1:
                raise LmforgeError(
                    f"one sequence's W-layer ring needs {per_slot / 2**30:.2f} GiB (window "
                    f"{cfg.window} + a {chunk}-token chunk, x {n_w} layers), more than half "
                    "the free device memory"
                )
            num_slots = min(num_slots, fit)  # more sequences wait for a slot (FCFS)
    if not mixers and ring is None:
        return None
    return StatePool(mixers, num_slots, device, dtype, ring=ring)


def kv_blocks_for_memory(
    free_bytes: int, fraction: float, reserve_bytes: int, per_block: int
) -> int:
    """KV blocks that fit in ``fraction`` of ``free_bytes`` (free device memory after weights
    and CUDA-graph capture) once ``reserve_bytes`` (activations of the largest eager step) are
    kept back; never negative."""
    if not 0 < fraction <= 1:
        raise LmforgeError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    return max(0, int(free_bytes * fraction) - int(reserve_bytes)) // int(per_block)
