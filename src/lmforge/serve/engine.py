"""The inference engine: paged KV cache, continuous batching, prefix caching, in-place updates.

Token ids in, token ids + logprobs out (the tokenizer stays outside, in the server). Each
:meth:`Engine.step` is one scheduling decision and one forward:

1. **Schedule** (FCFS, no starvation). Running sequences go first, in arrival order: a decoding
   one needs 1 token, a partly prefilled one its next chunk. If a sequence needs a new block and
   none is free, the most recently arrived running sequence is *preempted*: its blocks are freed
   and it goes back to the head of the queue to be recomputed later (its tokens so far are kept,
   so it resumes where it was; the prefix cache often makes the recompute cheap). Then waiting
   requests are admitted in order while the step's token budget and free blocks last; the first
   one that does not fit stops admission (nobody overtakes it). Prompts longer than the budget
   are prefilled in chunks over several steps (chunked prefill), mixed with other sequences'
   decodes in the same forward.
2. **Prefix cache** on admission: the longest run of the prompt's full blocks already cached
   (hash of parent hash + block tokens, :mod:`lmforge.serve.blocks`) is taken as is, and only
   the rest is computed. At least one token is always computed (its logits start sampling).
3. **Forward** (:func:`lmforge.serve.runner.forward_step`), then for each sequence whose step
   reached its last token: sample (:mod:`lmforge.serve.sampling`), record the logprob and the
   policy version, detokenize the token (engines with a tokenizer: O(that token), see
   :mod:`lmforge.serve.detok`), check stop conditions (stop ids, EOS, stop strings, which may
   span tokens); finished sequences free their blocks at once. Blocks that became full are
   registered in the prefix cache.

Weight updates (:meth:`Engine.update_weights`) copy tensors into the model's parameters between
two steps; running sequences keep their KV cache (computed under the old weights, as in-flight
RL updates do) and every token records the version it was sampled under. Cached prefixes of
finished requests are dropped (their KV belongs to the old weights).

KV memory: ``num_blocks`` blocks, by default (CUDA, or any device given a ``memory_probe``) a
fraction of the free device memory measured *after* the weights, the compiled decode step and
the CUDA-graph capture, minus the measured peak of the largest eager step
(:meth:`Engine._size_after_capture` says how: capture against a probe cache, measure, size,
recapture); on the CPU without a probe, 16 contexts capped at 1 GiB. Admission control, not
OOM: a request that could never fit is refused by :meth:`add_request`; one that does not fit
now waits.

Exercised by ``pytest tests/test_serve_engine.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lmforge.serve.blocks import BlockAllocator, block_hashes
from lmforge.serve.detok import IncrementalDetokenizer, StopMatcher, make_detokenizer
from lmforge.serve.runner import PagedKVCache, StepBatch, forward_step
from lmforge.serve.sampling import SamplingParams, apply_penalties, logprobs_of, sample_tokens
from lmforge.utils.errors import LmforgeError

__all__ = ["CompletionOutput", "Engine", "RequestOutput", "SamplingParams", "kv_blocks_for_memory"]

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (so far)."""

    token_ids: list[int]
    "generated ids (a stop token that ended the sample is the last one)"
    logprobs: list[float]
    "log_softmax(logits / T)[token] of each generated token (see lmforge.serve.sampling)"
    policy_versions: list[int]
    "weight version each token was sampled under"
    finish_reason: FinishReason | None
    "'stop' (stop id, EOS or stop string), 'length' (max_tokens or the context), None running"
    top_logprobs: list[dict[int, float]] | None = None
    "per token, the top-n alternatives' logprobs (with SamplingParams.logprobs)"
    index: int = 0
    "which of the request's n samples"
    text_pieces: list[str] = dataclasses.field(default_factory=list)
    "the text released so far, in pieces (engines with a tokenizer; see :attr:`text`)"
    stop_reason: str | int | None = None
    "what ended a 'stop' sample: the stop string matched, or the stop / EOS token id"

    @property
    def text(self) -> str:
        """The sample's text (engines with a tokenizer): final, never past a stop string; the
        token that ended the sample (EOS / stop id) and a matched stop string are not in it."""
        return "".join(self.text_pieces)


@dataclasses.dataclass
class RequestOutput:
    """A request's state as returned by :meth:`Engine.step` / :meth:`Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    "the request's prompt (the engine's own list, shared by its outputs: copy before changing)"
    outputs: list[CompletionOutput]
    finished: bool


@dataclasses.dataclass(eq=False)
class _Seq:
    """One sample being generated: its tokens, its KV blocks and its progress."""

    request_id: str
    index: int
    tokens: list[int]
    n_prompt: int
    params: SamplingParams
    generator: torch.Generator | None
    arrival: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    n_cached: int = 0  # tokens whose KV is in the blocks
    n_hashed: int = 0  # full blocks registered (or taken from) the prefix cache
    hashes: list[int] = dataclasses.field(default_factory=list)
    root: int = 0  # policy version the KV (and so the hash chain) was computed under
    out: CompletionOutput | None = None
    first_token_time: float | None = None
    detok: IncrementalDetokenizer | None = None  # engines with a tokenizer
    stops: StopMatcher | None = None  # requests with stop strings

    @property
    def n_out(self) -> int:
        return len(self.tokens) - self.n_prompt


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: list[int]
    seqs: list[_Seq]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.out is not None and s.out.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        # The prompt list is shared, not copied per step (O(prompt) per request per step
        # otherwise); the engine never changes it.
        outs = [s.out for s in self.seqs if s.out is not None]
        return RequestOutput(self.request_id, self.prompt, outs, self.finished)


class Engine:
    """Continuous-batching inference over a paged KV cache (see the module docstring).

    ``model`` is a :class:`~lmforge.model.TransformerLM` (moved to ``device`` and put in eval
    mode). ``eos_token_id`` ends samples unless ``SamplingParams.ignore_eos``. ``num_blocks``
    fixes the KV cache size (None: ``kv_memory_fraction`` of free CUDA memory, or on CPU 16 full
    contexts capped at 1 GiB). ``max_num_batched_tokens`` is the per-step token
    budget; ``max_num_seqs`` the most sequences in one step. ``seed`` seeds the generator used
    by unseeded requests. ``compile`` runs decode steps through ``torch.compile``
    (:mod:`lmforge.serve.compiled`; None: on for CUDA, off on the CPU; captured in the CUDA
    graphs when ``cuda_graphs``); if it fails, one line on stderr and eager decode.
    ``tokenizer`` (anything with ``decode(ids)``; ``id_to_bytes`` makes it byte-exact and
    cheaper) turns on text: every sample's :attr:`CompletionOutput.text` is detokenized
    incrementally as it is sampled (:mod:`lmforge.serve.detok`) and ``SamplingParams.stop``
    strings end samples. Without one the engine is ids-only, as before.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kv_memory_fraction: float = 0.8,
        enable_prefix_cache: bool = True,
        eos_token_id: int | None = None,
        kv_dtype: torch.dtype | None = None,
        use_triton: bool | None = None,
        seed: int = 0,
        max_queue: int | None = None,
        cuda_graphs: bool = False,
        compile: bool | None = None,
        tokenizer: Any = None,
        memory_probe: Callable[[], int] | None = None,
    ) -> None:
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.model = model.to(self.device).eval()
        cfg = model.config
        self.config = cfg
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, block_size)
        self.eos_token_id = eos_token_id
        self.use_triton = use_triton
        self.max_queue = max_queue
        self.tokenizer = tokenizer
        dtype = kv_dtype or next(self.model.parameters()).dtype
        self.kv_dtype = dtype
        self.kv_budget: dict[str, float] | None = None  # how the cache was sized from memory
        probe = memory_probe
        if probe is None and self.device.type == "cuda":
            dev = self.device

            def probe() -> int:
                return int(torch.cuda.mem_get_info(dev)[0])

        use_graphs = cuda_graphs and self._graphs_supported()
        want_compile = compile if compile is not None else self.device.type == "cuda"
        # One block more than the allocator hands out: CUDA-graph padding rows write there.
        if num_blocks is None and probe is not None:
            num_blocks = self._size_after_capture(
                probe, kv_memory_fraction, use_graphs, want_compile
            )
        else:
            if num_blocks is None:
                num_blocks = self._default_num_blocks(dtype)
            self.cache = self._new_cache(num_blocks + 1)
            self.decoder = self._make_decoder(want_compile)
            self.graphs = self._make_graphs() if use_graphs else None
            if self.graphs is None and self.decoder is not None:
                self.decoder.warmup(self.cache.num_blocks - 1, block_size)
        self.allocator = BlockAllocator(num_blocks, enable_prefix_cache=enable_prefix_cache)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.requests: dict[str, _Request] = {}
        self.policy_version = 0
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.lock = threading.RLock()  # step / add / abort / update_weights from several threads
        # decode_* / mixed_*: steps where every sequence fed one token (the graphs' case) vs
        # steps that carried prefill, and the wall seconds step() spent on each (host included)
        self.stats = {"preemptions": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "decode_steps": 0, "decode_s": 0.0, "mixed_steps": 0, "mixed_s": 0.0}  # fmt: skip

    # ---------------------------------------------------------------- sizing
    def _graphs_supported(self) -> bool:
        return self.device.type == "cuda"

    def _new_cache(self, n: int) -> PagedKVCache:
        cfg = self.config
        return PagedKVCache(
            cfg.n_layers, n, self.block_size, cfg.kv_heads, cfg.head_dim, self.device,
            self.kv_dtype,
        )  # fmt: skip

    def _make_decoder(self, want: bool) -> Any:
        # Decode steps through torch.compile (lmforge.serve.compiled); default on for CUDA.
        if not want:
            return None
        from lmforge.serve.compiled import CompiledDecode

        return CompiledDecode(self.model, self.cache, self.use_triton)

    def _make_graphs(self) -> Any:
        from lmforge.serve.cuda_graphs import DecodeGraphs

        return DecodeGraphs(self)  # compiles while warming up each bucket

    def _default_num_blocks(self, dtype: torch.dtype) -> int:
        """CPU without a memory probe: 16 full contexts, at most 1 GiB (at least one context)."""
        per_block = PagedKVCache.bytes_per_block(self.model, self.block_size, dtype)
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
        per_block = PagedKVCache.bytes_per_block(self.model, self.block_size, self.kv_dtype)
        blocks_per_seq = math.ceil(self.config.context_length / self.block_size)
        n_seqs = math.ceil(self.max_num_batched_tokens / max(self.config.context_length - 1, 1))
        n_probe = math.ceil(self.max_num_batched_tokens / self.block_size) + n_seqs + 2
        self.cache = self._new_cache(n_probe + 1)
        self.decoder = self._make_decoder(want_compile)
        free_before = probe()
        self.graphs = self._make_graphs() if use_graphs else None
        if self.graphs is None and self.decoder is not None:
            self.decoder.warmup(self.cache.num_blocks - 1, self.block_size)
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
        tokens, positions, slots, tables, rows = [], [], [], [], []
        block = 0
        for n in lens:
            table = list(range(block, block + math.ceil(n / bs)))
            block += len(table)
            tables.append(table)
            tokens += [0] * n
            positions += range(n)
            slots += [table[p // bs] * bs + p % bs for p in range(n)]
            rows.append(len(tokens) - 1)
        assert block <= n_probe
        width = max(len(t) for t in tables)
        batch = StepBatch(
            tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slots=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            ctx_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            last_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            q_lens=lens,
            ctx_lens_list=lens,
            tables_list=tables,
        )
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        forward_step(self.model, self.cache, batch, use_triton=self.use_triton)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del batch
        torch.cuda.empty_cache()
        # log_softmax, probabilities, exponential noise, their ratio, a float copy: (S, V) fp32.
        sampler = 6 * self.max_num_seqs * self.config.vocab_size * 4
        return int(peak + sampler)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Turn on text (and stop strings) for requests added from now on."""
        with self.lock:
            self.tokenizer = tokenizer

    # ---------------------------------------------------------------- requests
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints if the engine can ever run the request, else raise
        :class:`LmforgeError` (one line). Reads only fixed state: safe from any thread."""
        prompt = [int(t) for t in prompt_token_ids]
        ctx = self.config.context_length
        if not prompt:
            raise LmforgeError("the prompt needs at least one token")
        if any(t < 0 or t >= self.config.vocab_size for t in prompt):
            raise LmforgeError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if len(prompt) >= ctx:
            raise LmforgeError(
                f"prompt has {len(prompt)} tokens; the model's context is {ctx} "
                "(at least one token must be generated)"
            )
        need = math.ceil(min(len(prompt) + params.max_tokens, ctx) / self.block_size)
        if need > self.allocator.num_blocks:
            raise LmforgeError(
                f"request needs {need} KV blocks, the cache has {self.allocator.num_blocks}"
            )
        params.check_vocab(self.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise LmforgeError("stop strings need an engine with a tokenizer (Engine(tokenizer=))")
        return prompt

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt; returns its request id. Invalid requests raise :class:`LmforgeError`."""
        params = params or SamplingParams()
        prompt = self.check_request(prompt_token_ids, params)
        with self.lock:
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self.requests:
                raise LmforgeError(f"request id {rid!r} is already in use")
            seqs = []
            for i in range(params.n):
                gen = None
                if params.seed is not None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(params.seed + i)
                seq = _Seq(rid, i, list(prompt), len(prompt), params, gen, next(self._arrivals))
                seq.out = CompletionOutput([], [], [], None, [] if params.logprobs else None, i)
                if self.tokenizer is not None:
                    seq.detok = make_detokenizer(self.tokenizer, prompt)
                    if params.stop:
                        seq.stops = StopMatcher(params.stop)
                seqs.append(seq)
            self.requests[rid] = _Request(rid, prompt, seqs, time.monotonic())
            self.waiting.extend(seqs)
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free its blocks; unknown ids are ignored."""
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return
            for seq in req.seqs:
                self._release(seq)
                if seq in self.running:
                    self.running.remove(seq)
                if seq in self.waiting:
                    self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- weights
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
    ) -> None:
        """Copy ``(name, tensor)`` pairs (state-dict names; any iterable, e.g. a bucketed
        stream) into the model in place, between two steps; later tokens carry ``version``.

        Running requests keep their KV cache; the prefix cache of finished ones is dropped.
        Unknown names or wrong shapes raise one line (nothing is half-applied for that tensor).
        """
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        with self.lock, torch.no_grad():
            params = dict(self.model.named_parameters(remove_duplicate=False))
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    raise LmforgeError(f"update_weights: the model has no parameter {name!r}")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise LmforgeError(
                        f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                        f"the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self.policy_version = int(version)
            # Hash chains are rooted at the version they were computed under, so old KV never
            # matches a new lookup; dropping the idle cached blocks just frees them sooner.
            self.allocator.reset_prefix_cache()

    # ---------------------------------------------------------------- scheduling
    def _release(self, seq: _Seq) -> None:
        if seq.blocks:
            self.allocator.free_all(seq.blocks)
        seq.blocks = []
        seq.n_cached = 0
        seq.n_hashed = 0

    def _ensure_blocks(self, seq: _Seq, n_tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``n_tokens`` slots; False (nothing kept) if short."""
        need = math.ceil(n_tokens / self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.allocator.allocate())
        return True

    def _take_prefix(self, seq: _Seq) -> None:
        """Reuse cached full blocks of ``seq``'s tokens (never its last token's block)."""
        if seq.blocks:
            return
        seq.root = self.policy_version
        root = hash(("policy", seq.root))
        seq.hashes = block_hashes(seq.tokens[: len(seq.tokens) - 1], self.block_size, root)
        for h in seq.hashes:
            block = self.allocator.lookup(h)
            if block is None:
                break
            seq.blocks.append(block)
        seq.n_cached = seq.n_hashed = len(seq.blocks)
        seq.n_cached *= self.block_size

    def _preempt(self) -> _Seq | None:
        """Preempt the most recent running sequence (returned); None if none is left."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1
        return victim

    def _schedule(self) -> list[tuple[_Seq, int]]:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[_Seq, int]] = []
        preempted: set[int] = set()  # ids, not `in self.running`: O(1), not O(S), per sequence
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if id(seq) in preempted:
                continue  # preempted below to make room for an earlier one
            n = min(len(seq.tokens) - seq.n_cached, budget)
            if n <= 0:
                continue
            while not self._ensure_blocks(seq, seq.n_cached + n):
                victim = self._preempt()
                if victim is None:
                    break
                preempted.add(id(victim))
                if victim is seq:
                    break
            if id(seq) in preempted:
                continue
            if math.ceil((seq.n_cached + n) / self.block_size) > len(seq.blocks):
                continue
            chosen.append((seq, n))
            budget -= n
            if budget <= 0:
                break
        n_running = len(self.running)
        while self.waiting and budget > 0 and n_running < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._siblings_prompt_ready(seq):
                break  # next step it shares sample 0's prompt blocks instead of recomputing
            self._take_prefix(seq)
            n = min(len(seq.tokens) - seq.n_cached, budget)
            if not self._ensure_blocks(seq, seq.n_cached + n):
                self._release(seq)  # give the prefix back: it waits whole (FCFS, no skipping)
                break
            self.waiting.popleft()
            self.running.append(seq)
            n_running += 1
            chosen.append((seq, n))
            budget -= n
        return chosen

    def _siblings_prompt_ready(self, seq: _Seq) -> bool:
        """Whether sample ``seq`` (of n > 1) may start: sample 0 has prefilled the prompt, so
        its full blocks are in the prefix cache (always true for sample 0 or without a cache)."""
        if seq.index == 0 or not self.allocator.enable_prefix_cache:
            return True
        req = self.requests.get(seq.request_id)
        if req is None:
            return True
        first = req.seqs[0]
        return first.n_cached >= first.n_prompt or (
            first.out is not None and first.out.finish_reason is not None
        )

    # ---------------------------------------------------------------- the step
    def _batch(self, chosen: list[tuple[_Seq, int]]) -> StepBatch:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for seq, n in chosen:
            start = seq.n_cached
            for p in range(start, start + n):
                block = seq.blocks[p // bs]
                if p % bs == 0 or p == start:
                    self.allocator.check_writable(block)
                slots.append(block * bs + p % bs)
            tokens.extend(seq.tokens[start : start + n])
            positions.extend(range(start, start + n))
            last_rows.append(len(tokens) - 1)
        width = max(len(seq.blocks) for seq, _ in chosen)
        ctx = [seq.n_cached + n for seq, n in chosen]
        n_tok, n_seq = len(tokens), len(chosen)
        # Two host tensors (int64: tokens, positions, slots, rows; int32: tables, context
        # lengths), one copy each to the device; the step's inputs are views of them.
        longs = tokens + positions + slots + last_rows
        ints = ctx.copy()
        for seq, _ in chosen:
            ints += seq.blocks
            ints += [0] * (width - len(seq.blocks))
        dev64, dev32 = self._to_device(longs, ints)
        return StepBatch(
            tokens=dev64[:n_tok],
            positions=dev64[n_tok : 2 * n_tok],
            slots=dev64[2 * n_tok : 3 * n_tok],
            block_tables=dev32[n_seq:].view(n_seq, width),
            ctx_lens=dev32[:n_seq],
            last_rows=dev64[3 * n_tok :],
            q_lens=[n for _, n in chosen],
            ctx_lens_list=ctx,
            tables_list=[seq.blocks for seq, _ in chosen],
        )

    def _to_device(self, longs: list[int], ints: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's int64 and int32 inputs on the device. On CUDA through persistent pinned
        staging buffers (grown as needed) with asynchronous copies; an event recorded after
        the copies is waited on before the buffers are refilled (a step whose sequences are
        all mid-prefill reads nothing back, so it does not synchronise by itself)."""
        a = torch.tensor(longs, dtype=torch.long)
        b = torch.tensor(ints, dtype=torch.int32)
        if self.device.type != "cuda":
            return a, b
        stage = getattr(self, "_stage", None)
        if stage is None or stage[0].numel() < a.numel() or stage[1].numel() < b.numel():
            stage = (
                torch.empty(max(2 * a.numel(), 1024), dtype=torch.long, pin_memory=True),
                torch.empty(max(2 * b.numel(), 1024), dtype=torch.int32, pin_memory=True),
            )
            self._stage = stage
        done = getattr(self, "_stage_done", None)
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
        return forward_step(self.model, self.cache, batch, use_triton=self.use_triton)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.decode_only:
            if self.graphs is not None:
                logits = self.graphs.run(batch)
                if logits is not None:
                    return logits
            return self.decode_step(batch)
        return forward_step(self.model, self.cache, batch, use_triton=self.use_triton)

    def _register_full_blocks(self, seq: _Seq) -> None:
        if not self.allocator.enable_prefix_cache:
            return
        full = seq.n_cached // self.block_size
        if full <= seq.n_hashed:
            return
        parent = seq.hashes[seq.n_hashed - 1] if seq.n_hashed else hash(("policy", seq.root))
        new = block_hashes(
            seq.tokens[seq.n_hashed * self.block_size : full * self.block_size],
            self.block_size,
            parent,
        )
        seq.hashes = seq.hashes[: seq.n_hashed] + new
        for i in range(seq.n_hashed, full):
            self.allocator.register(seq.blocks[i], seq.hashes[i])
        seq.n_hashed = full

    def _finish_reason(self, seq: _Seq, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (
            not p.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id
        ):
            return "stop"
        if seq.n_out >= p.max_tokens or len(seq.tokens) >= self.config.context_length:
            return "length"
        return None

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; the requests that got a token (or finished)."""
        t_start = time.perf_counter()
        with self.lock:
            chosen = self._schedule()
            if not chosen:
                return []
            batch = self._batch(chosen)
            kind = "decode" if batch.decode_only else "mixed"
            logits = self._forward(batch)  # (S, V)
            for seq, n in chosen:
                seq.n_cached += n
                self._register_full_blocks(seq)
            ready = [
                (i, seq) for i, (seq, _) in enumerate(chosen) if seq.n_cached == len(seq.tokens)
            ]
            self.stats["steps"] += 1
            self.stats["prompt_tokens"] += sum(
                n for seq, n in chosen if seq.n_cached - n < seq.n_prompt
            )
            touched: dict[str, _Request] = {}
            if ready:
                if len(ready) < len(chosen):  # some sequences are mid-prefill: no token yet
                    rows = torch.tensor([i for i, _ in ready], device=self.device)
                    logits = logits[rows]
                params = [seq.params for _, seq in ready]
                logits = apply_penalties(
                    logits, params, [s.tokens for _, s in ready], [s.n_prompt for _, s in ready]
                )  # (R, V)
                lp = logprobs_of(logits, params)  # (R, V)
                gens = [seq.generator for _, seq in ready]
                toks = sample_tokens(lp, params, gens, default_generator=self.generator)
                chosen_lp = lp.gather(1, toks[:, None])[:, 0]
                if lp.is_cuda:  # one device-to-host read (a sync) for both; ids < 2^53 exact
                    both = torch.stack((toks.double(), chosen_lp.double())).tolist()
                    toks_l, lp_l = [int(t) for t in both[0]], both[1]
                else:
                    toks_l, lp_l = toks.tolist(), chosen_lp.tolist()
                tops: list[dict[int, float] | None] = [None] * len(ready)
                want = max((p.logprobs or 0) for p in params)
                if want:
                    tv, ti = lp.topk(want, dim=-1)
                    tv_l, ti_l = tv.tolist(), ti.tolist()
                    for j, p in enumerate(params):
                        if p.logprobs:
                            tops[j] = dict(zip(ti_l[j][: p.logprobs], tv_l[j][: p.logprobs]))
                now = time.monotonic()
                for j, (_, seq) in enumerate(ready):
                    tok = toks_l[j]
                    seq.tokens.append(tok)
                    out = seq.out
                    assert out is not None
                    out.token_ids.append(tok)
                    out.logprobs.append(lp_l[j])
                    out.policy_versions.append(self.policy_version)
                    if out.top_logprobs is not None:
                        out.top_logprobs.append(tops[j] or {})
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    self.stats["generated_tokens"] += 1
                    reason = self._finish_reason(seq, tok)
                    if reason == "stop":
                        out.stop_reason = tok
                    if seq.detok is not None:
                        reason = self._detokenize(seq, out, tok, reason)
                    if reason is not None:
                        out.finish_reason = reason
                        self.running.remove(seq)
                        self._release_finished(seq)
                    req = self.requests.get(seq.request_id)
                    if req is not None:
                        touched[req.request_id] = req
            outs = []
            for rid, req in touched.items():
                outs.append(req.output())
                if outs[-1].finished:
                    del self.requests[rid]
            self.stats[f"{kind}_steps"] += 1
            self.stats[f"{kind}_s"] += time.perf_counter() - t_start
            return outs

    @staticmethod
    def _detokenize(
        seq: _Seq, out: CompletionOutput, tok: int, reason: FinishReason | None
    ) -> FinishReason | None:
        """Release ``tok``'s text (O(this token)); a stop string ends the sample here."""
        assert seq.detok is not None
        if reason == "stop":  # EOS / a stop id: the token itself is not text
            piece = seq.detok.flush()
        else:
            piece = seq.detok.feed(tok)
            if reason is not None:
                piece += seq.detok.flush()
        if seq.stops is not None:
            piece, hit = seq.stops.feed(piece)
            if hit is not None:
                out.stop_reason = hit
                reason = "stop"
            elif reason is not None:
                piece += seq.stops.flush()
        if piece:
            out.text_pieces.append(piece)
        return reason

    def _release_finished(self, seq: _Seq) -> None:
        # Register what is full before letting go, so a follow-up request can reuse it.
        self._register_full_blocks(seq)
        self._release(seq)

    # ---------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise LmforgeError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def kv_blocks_for_memory(
    free_bytes: int, fraction: float, reserve_bytes: int, per_block: int
) -> int:
    """KV blocks that fit in ``fraction`` of ``free_bytes`` (free device memory after weights
    and CUDA-graph capture) once ``reserve_bytes`` (activations of the largest eager step) are
    kept back; never negative."""
    if not 0 < fraction <= 1:
        raise LmforgeError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    return max(0, int(free_bytes * fraction) - int(reserve_bytes)) // int(per_block)


class QueueFull(LmforgeError):
    """The engine's waiting queue is at ``max_queue`` (the server answers 429)."""
