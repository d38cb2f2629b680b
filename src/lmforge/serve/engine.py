"""The inference engine: continuous batching over a paged KV cache, in-place weight updates.

Token ids in, token ids + logprobs out (the tokenizer stays outside, in the server; with one,
text and stop strings are handled here incrementally). The engine is thin; its parts are the
field's usual split:

- :class:`~lmforge.serve.scheduler.Scheduler` (plain Python): admission, chunked prefill under a
  token budget, preemption by recompute, the prefix cache (a hit compares the block's tokens);
- :class:`~lmforge.serve.model_runner.ModelRunner`: KV cache sizing, CUDA graphs, the compiled
  decode step, host-to-device staging, and the model's own forward
  (``TransformerLM.forward`` with a paged context: every model switch as in training);
- the engine: requests, sampling (:mod:`lmforge.serve.sampling`: logprob and policy version of
  every token), detokenization and stop conditions (stop ids, EOS, stop strings, which may span
  tokens); finished sequences free their blocks at once.

Each :meth:`Engine.step` is one scheduling decision, one forward and one sampling pass.
Weight updates (:meth:`Engine.update_weights`) copy tensors into the model's parameters between
two steps; running sequences keep their KV cache (computed under the old weights, as in-flight
RL updates do) and every token records the version it was sampled under. Cached prefixes of
finished requests are dropped (their KV belongs to the old weights). Admission control, not
OOM: a request that could never fit is refused by :meth:`Engine.add_request`; one that does not
fit now waits. Speculative decoding is a mode of the engine (``Engine(speculative=...)``).

Hybrid layer patterns (``model.layers``): linear layers (G, M, L) keep one recurrent-state
slot per running sequence (:class:`~lmforge.model.linear_attention.StatePool`, ``max_num_seqs``
slots; prefix cache off, preemption recomputes from a zeroed slot); W layers read the window
of their pages, and where every paged layer is a W layer the blocks behind a sequence's window
go back to the pool as it grows (:meth:`Scheduler.trim_window`: a sequence holds its window's
blocks, not its length's), while W layers beside A/S layers keep their K/V in a ring per state
slot (:meth:`StatePool.ring_context <lmforge.model.linear_attention.StatePool.ring_context>`;
the shared pool pages the A/S layers only; prefix cache off); S layers page their indexer keys beside their K/V (same blocks: a prefix hit
serves both) and select their top-k keys per sequence; hybrids, like MLA models, decode through
the compiled step and CUDA graphs (:mod:`lmforge.serve.compiled`), DSA (S) layers included.

Exercised by ``pytest tests/test_serve_engine.py tests/test_engine_switches.py
tests/test_serve_hybrid.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lmforge.model.context import PagedKVCache
from lmforge.model.kv_cache import window_ring
from lmforge.model.mla import PagedLatentCache
from lmforge.serve.attention import kv_cache_dtype as kv_cache_dtype_of
from lmforge.serve.blocks import BlockAllocator
from lmforge.serve.detok import StopMatcher, make_detokenizer, release
from lmforge.serve.model_runner import ModelRunner, StepBatch, kv_blocks_for_memory, ring_chunk
from lmforge.serve.sampling import SamplingParams, apply_penalties, logprobs_of, sample_tokens
from lmforge.serve.scheduler import Scheduler, Seq, check_fits
from lmforge.serve.step import as_decode_rows
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.serve.speculative import DraftModel, MTPDraft, NgramDraft, Speculative
    from lmforge.vision.serving import ImagePrompt

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


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: list[int]
    seqs: list[Seq]

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
    by unseeded requests. Defaults are the measured-best path: ``cuda_graphs`` (decode steps
    replayed from CUDA graphs, :mod:`lmforge.serve.cuda_graphs`) and ``compile`` (decode steps
    through ``torch.compile``, :mod:`lmforge.serve.compiled`, captured in the graphs) are on
    for CUDA and off on the CPU when None; False turns either off. With ``compile``, prefill
    (mixed) steps of full-attention models go through ``torch.compile`` too (one dynamic graph
    for every mix of chunk lengths; ``compile_prefill=False`` keeps them eager). If compiling
    fails, one line on stderr and that step runs eagerly. :attr:`startup_line` says in one line what was chosen (the
    CLI prints it).
    ``tokenizer`` (anything with ``decode(ids)``; ``id_to_bytes`` makes it byte-exact and
    cheaper) turns on text: every sample's :attr:`CompletionOutput.text` is detokenized
    incrementally as it is sampled (:mod:`lmforge.serve.detok`) and ``SamplingParams.stop``
    strings end samples. Without one the engine is ids-only, as before. ``speculative``
    (:class:`~lmforge.serve.speculative.Speculative`, or a bare ``NgramDraft`` /
    ``DraftModel``) turns on speculative decoding: one sequence at a time (``max_num_seqs`` 1,
    n = 1 per request), greedy output token-identical to plain decoding.
    ``kv_cache_dtype`` ``"fp8"`` / ``"int8"`` stores the KV pages quantized (e4m3 / symmetric
    int8 values with a float32 scale per token and kv-head, :mod:`lmforge.serve.attention`):
    about half the bytes of bf16 per block, so about twice the blocks; ``"auto"`` (default)
    stores them in ``kv_dtype`` (None: the model's dtype).
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
        kv_cache_dtype: str = "auto",
        use_triton: bool | None = None,
        seed: int = 0,
        max_queue: int | None = None,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        compile_prefill: bool | None = None,
        tokenizer: Any = None,
        memory_probe: Callable[[], int] | None = None,
        speculative: Speculative | NgramDraft | DraftModel | MTPDraft | None = None,
    ) -> None:
        param = next(model.parameters())
        if kv_dtype is None:  # fp8 / int8: quantized pages (lmforge.serve.attention)
            kv_dtype = kv_cache_dtype_of(kv_cache_dtype)
        if kv_dtype in (torch.float8_e4m3fn, torch.int8) and (
            model.config.attention_type == "mla" or int(model.config.head_dim) % 4
        ):
            raise LmforgeError(
                f"--kv-cache-dtype {kv_cache_dtype}: quantized KV pages need GQA/MHA attention "
                f"with a head dim divisible by 4 (this model: {model.config.attention_type}, "
                f"head dim {model.config.head_dim})"
            )
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
        self.speculative: Speculative | None = None
        # a cached block holds K/V, not the recurrent state (or W ring) after it: recompute
        if any(kind in "GML" for kind in cfg.layer_types) or window_ring(cfg.layer_types):
            enable_prefix_cache = False
            if speculative is not None:
                raise LmforgeError(
                    f"speculative decoding cannot roll back the per-sequence state of layers "
                    f"{cfg.layers!r} (G/M/L states, W rings beside A/S): serve without "
                    "--speculative"
                )
        if speculative is not None:  # batch 1: the latency case the technique is for
            self.speculative = _speculative(speculative, self.model)
            max_num_seqs = self.max_num_seqs = 1
            if self.speculative.tap is not None:  # MTP drafts read every prompt row's hidden
                enable_prefix_cache = False
        self.runner = ModelRunner(
            self.model, device=self.device, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, kv_dtype=kv_dtype,
            use_triton=use_triton, num_blocks=num_blocks, kv_memory_fraction=kv_memory_fraction,
            cuda_graphs=cuda_graphs, compile=compile, compile_prefill=compile_prefill,
            memory_probe=memory_probe,
            # a verify is k + 1 decode rows of the one sequence: graphs up to that many rows
            max_decode_rows=None if self.speculative is None else self.speculative.k + 1,
        )  # fmt: skip
        if self.speculative is not None:  # its proposer's CUDA graphs follow the engine's
            self.speculative.graphs_default(self.runner.use_graphs)
        # every paged layer a sliding window (W, with or without linear layers): blocks behind
        # a sequence's window go back to the pool; an A or S layer needs every page
        kv_kinds = {c for c in cfg.layer_types if c not in "GML"}
        self.window = cfg.window if kv_kinds == {"W"} and cfg.attention_type != "mla" else None
        self.scheduler = Scheduler(
            self.runner.num_blocks, block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_cache=enable_prefix_cache,
            num_state_slots=0 if self.runner.states is None else self.runner.states.num_slots,
            window=self.window, null_block=self.runner.num_blocks,  # (the scratch block)
            max_seq_tokens=ring_chunk(cfg.window, self.max_num_batched_tokens)
            if window_ring(cfg.layer_types) else None,  # a W ring holds window + one chunk
        )  # fmt: skip
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.lock = threading.RLock()  # step / add / abort / update_weights from several threads
        self.startup_line = self.runner.describe()
        if not cfg.full_attention_only:
            self.startup_line += ", " + _hybrid_memory(self.runner, cfg, self.window)
        if self.speculative is not None:
            name = type(self.speculative.draft).__name__
            self.startup_line += f", speculative decoding ({name}, k={self.speculative.k}, batch 1)"
        # decode_* / mixed_* / spec_*: steps where every sequence fed one token (the graphs'
        # case), steps that carried prefill, speculative steps; wall and CPU seconds of each
        self.stats: dict[str, float] = {
            "preemptions": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
        }
        for kind in ("decode", "mixed", "spec"):
            self.stats.update({f"{kind}_steps": 0, f"{kind}_s": 0.0, f"{kind}_cpu_s": 0.0})

    # the parts, as attributes callers and tests read
    @property
    def policy_version(self) -> int:
        """Weight version new tokens are sampled under (and prefix-cache keys are rooted at)."""
        return self.scheduler.version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.scheduler.version = int(value)

    @property
    def allocator(self) -> BlockAllocator:
        return self.scheduler.allocator

    @property
    def waiting(self) -> deque[Seq]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Seq]:
        return self.scheduler.running

    @property
    def cache(self) -> PagedKVCache | PagedLatentCache:
        return self.runner.cache

    @property
    def decoder(self) -> Any:
        """The compiled decode step (None: eager)."""
        return self.runner.decoder

    @property
    def graphs(self) -> Any:
        """The CUDA graphs (None: not captured)."""
        return self.runner.graphs

    @property
    def kv_budget(self) -> dict[str, float] | None:
        """How the KV cache was sized from free memory (None: given or the CPU default)."""
        return self.runner.kv_budget

    # ---------------------------------------------------------------- requests
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints if the engine can ever run the request, else raise
        :class:`LmforgeError` (one line). Reads only fixed state: safe from any thread."""
        prompt = [int(t) for t in prompt_token_ids]
        if any(t < 0 or t >= self.config.vocab_size for t in prompt):
            raise LmforgeError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        check_fits(len(prompt), params.max_tokens, self.config.context_length, self.block_size,
                   self.allocator.num_blocks, self.window, self.max_num_batched_tokens)  # fmt: skip
        if self.speculative is not None and params.n != 1:
            raise LmforgeError("speculative decoding serves one sample per request (n = 1)")
        if self.speculative is not None and params.penalised:
            raise LmforgeError(
                "speculative decoding does not apply logit_bias or penalties: drop them "
                "or serve without --speculative"
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
        image_embeds: ImagePrompt | None = None,
    ) -> str:
        """Queue a prompt; returns its request id. Invalid requests raise :class:`LmforgeError`.

        ``image_embeds`` (a VLM prompt, :func:`lmforge.vision.serving.prepare_image_prompt`):
        the rows of the prompt's image slots replace those tokens' embeddings in prefill, and
        the slots' prefix-cache keys are their images' digests."""
        params = params or SamplingParams()
        prompt = self.check_request(prompt_token_ids, params)
        if image_embeds is not None:
            image_embeds = self._check_images(image_embeds, len(prompt))
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
                first = seqs[0] if seqs else None
                seq = Seq(rid, i, list(prompt), len(prompt), next(self._arrivals), first=first)
                seq.params, seq.generator, seq.images = params, gen, image_embeds
                seq.out = CompletionOutput([], [], [], None, [] if params.logprobs else None, i)
                if self.tokenizer is not None:
                    seq.detok = make_detokenizer(self.tokenizer, prompt)
                    if params.stop:
                        seq.stops = StopMatcher(params.stop)
                seqs.append(seq)
            self.requests[rid] = _Request(rid, prompt, seqs)
            self.scheduler.add(seqs)
        return rid

    def _check_images(self, images: ImagePrompt, n_prompt: int) -> ImagePrompt:
        """``images`` with its embeddings on the engine's device and dtype, once; spans that
        overlap or leave the prompt, or rows that do not match them, raise one line."""
        if self.config.mrope_sections and getattr(self.speculative, "tap", None) is not None:
            raise LmforgeError("images with an MRoPE model (model.mrope_sections) do not run"
                               " with MTP drafts yet; serve without --speculative mtp")  # fmt: skip
        end = 0
        for s, n in images.spans:
            if s < end or n < 1 or s + n > n_prompt:
                raise LmforgeError(f"image span ({s}, {n}) is not inside a {n_prompt}-token prompt")
            end = s + n
        rows = sum(n for _, n in images.spans)
        want = (rows, self.config.d_model)
        if tuple(images.embeds.shape) != want or len(images.digests) != len(images.spans):
            raise LmforgeError(
                f"image embeddings {tuple(images.embeds.shape)} for {len(images.spans)} span(s) "
                f"and {len(images.digests)} digest(s): expected {want} and one digest per span"
            )
        dtype = next(self.model.parameters()).dtype
        return dataclasses.replace(images, embeds=images.embeds.to(self.device, dtype))

    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free its blocks; unknown ids are ignored."""
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return
            for seq in req.seqs:
                self.scheduler.remove(seq)

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_unfinished()

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
            # Key chains are rooted at the version they were computed under, so old KV never
            # matches a new lookup; dropping the idle cached blocks just frees them sooner.
            self.scheduler.reset_prefix_cache(int(version))

    # ---------------------------------------------------------------- the step
    def _batch(self, chosen: list[tuple[Seq, int]]) -> StepBatch:
        """The step's inputs on the device (scheduler's host lists, staged by the runner)."""
        inputs = self.scheduler.inputs(chosen)
        mrope = None
        if self.config.mrope_sections and any(seq.images is not None for seq, _ in chosen):
            # MRoPE prompts with images: grid positions, the text after an image shifted
            from lmforge.vision.mrope import engine_step_positions

            rows = [(s.images and s.images.spans, s.n_cached, n) for s, n in chosen]
            inputs.positions, mrope = engine_step_positions(rows)
        batch = self.runner.prepare(inputs)
        if mrope is not None:
            batch.mrope_positions = torch.tensor(mrope, device=batch.positions.device)  # (3, N)
        return batch

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (S, V) of each sequence's last token in the step."""
        return self.runner.run(batch)

    def _finish_reason(self, seq: Seq, token: int) -> FinishReason | None:
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
        t_start, c_start = time.perf_counter(), time.process_time()
        with self.lock:
            chosen = self.scheduler.schedule()
            if not chosen:
                return []
            touched: dict[str, _Request] = {}
            kind = "spec"
            if self.speculative is None or not self._spec_step(chosen, touched):
                kind = self._plain_step(chosen, touched)
            self.stats["steps"] += 1
            outs = []
            for rid, req in touched.items():
                outs.append(req.output())
                if outs[-1].finished:
                    del self.requests[rid]
            self.stats["preemptions"] = self.scheduler.preemptions
            self.stats[f"{kind}_steps"] += 1
            self.stats[f"{kind}_s"] += time.perf_counter() - t_start
            self.stats[f"{kind}_cpu_s"] += time.process_time() - c_start
            return outs

    def _plain_step(self, chosen: list[tuple[Seq, int]], touched: dict[str, _Request]) -> str:
        """One forward over the chosen sequences, one token sampled for each that is ready;
        returns the step's kind ("decode": one token per sequence, else "mixed")."""
        batch = self._batch(chosen)
        kind = "decode" if batch.decode_only else "mixed"
        logits = self._forward(batch)  # (S, V)
        ready = self.scheduler.advance(chosen)
        self.stats["prompt_tokens"] += sum(
            n for seq, n in chosen if seq.n_cached - n < seq.n_prompt
        )
        if not ready:
            return kind
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
        tops = _top_logprobs(lp, params)
        for j, (_, seq) in enumerate(ready):
            self._emit(seq, toks_l[j], lp_l[j], tops[j], touched)
        return kind

    def _emit(
        self,
        seq: Seq,
        tok: int,
        logprob: float,
        top: dict[int, float] | None,
        touched: dict[str, _Request],
    ) -> bool:
        """Append a sampled token to ``seq`` and its output; True if that finished it."""
        seq.tokens.append(tok)
        out = seq.out
        assert out is not None
        out.token_ids.append(tok)
        out.logprobs.append(logprob)
        out.policy_versions.append(self.policy_version)
        if out.top_logprobs is not None:
            out.top_logprobs.append(top or {})
        self.stats["generated_tokens"] += 1
        reason = self._finish_reason(seq, tok)
        if reason == "stop":
            out.stop_reason = tok
        if seq.detok is not None:  # the token's text, O(this token); a stop string ends here
            piece, hit = release(seq.detok, seq.stops, tok, reason)
            if hit is not None:
                out.stop_reason, reason = hit, "stop"
            if piece:
                out.text_pieces.append(piece)
        if reason is not None:
            out.finish_reason = reason
            self.scheduler.finish(seq)
        req = self.requests.get(seq.request_id)
        if req is not None:
            touched[req.request_id] = req
        return reason is not None

    def _spec_step(self, chosen: list[tuple[Seq, int]], touched: dict[str, _Request]) -> bool:
        """A speculative step of the one running sequence (batch 1) when it is decoding and the
        proposer has drafts: one target forward over its last token and the k drafts, exact
        rejection sampling (:func:`~lmforge.serve.speculative.verify`), 1 to k + 1 tokens
        emitted. False (nothing done): a plain step instead (prefill, or no drafts)."""
        from lmforge.serve.speculative import propose, verify, verify_greedy, verify_probs

        (seq, n), spec = chosen[0], self.speculative
        assert spec is not None
        if len(chosen) != 1 or n != 1:
            return False
        p = seq.params
        room = min(p.max_tokens - seq.n_out, self.config.context_length - len(seq.tokens))
        k = max(0, min(spec.k, room - 1))
        gen = seq.generator if seq.generator is not None else self.generator
        drafts, q = propose(spec, seq, k, p, gen, self.block_size) if k else ([], None)
        on_device = isinstance(drafts, torch.Tensor)  # MTP drafts: read with the results below
        k = drafts.numel() if on_device else len(drafts)
        if not k or not self.scheduler.ensure_blocks(seq, seq.n_cached + 1 + k):
            return False
        old_len = len(seq.tokens)
        seq.tokens.extend([0] * k if on_device else drafts)  # the verify forward's inputs
        batch = self._batch([(seq, k + 1)])
        del seq.tokens[old_len:]  # taken back: the emitted tokens are appended below
        if on_device:
            batch.tokens[1:].copy_(drafts)  # the placeholders' rows get the drafts
        d = batch.tokens[1:]  # (k,) the drafts, on the device (staged with the step's inputs)
        # k + 1 decode rows: the compiled step and graphs (an MTP proposer's tap is fed there too)
        if self.runner.states is None and batch.image_rows is None:
            batch = as_decode_rows(batch)
        else:
            batch.last_rows = torch.arange(k + 1, device=self.device)  # logits of every row
        logits = self._forward(batch)  # (k+1, V)
        if p.greedy:  # (1,), (1,)
            n_acc, nxt = verify_greedy(logits, d)
        else:
            qb = None if q is None else q[None]
            n_acc, nxt = verify(verify_probs(logits, p)[None], qb, d[None], gen)
        lp = logprobs_of(logits, [p] * (k + 1))  # (k+1, V)
        lp_d = lp[:k].gather(1, d[:, None])[:, 0]  # (k,) each draft's logprob at its row
        lp_n = lp.index_select(0, n_acc).gather(1, nxt[:, None])[:, 0]  # (1,) the last token's
        # one device-to-host read (a sync) for all of it (and the device drafts); ids < 2^53
        # are exact in float64
        parts = [n_acc.double(), nxt.double(), lp_d.double(), lp_n.double()]
        vals = torch.cat(parts + ([d.double()] if on_device else [])).tolist()
        if on_device:
            drafts = [int(x) for x in vals[3 + k :]]
        n_acc_i = int(vals[0])
        emitted = [*drafts[:n_acc_i], int(vals[1])]
        lp_l = [*vals[2 : 2 + n_acc_i], vals[2 + k]]
        spec.stats.drafted += k
        spec.stats.accepted += n_acc_i
        tops = _top_logprobs(lp, [p] * (k + 1))
        for j, tok in enumerate(emitted):
            seq.n_cached = len(seq.tokens)  # the KV of every token so far is in the pages
            if self._emit(seq, tok, lp_l[j], tops[j], touched):
                break
        else:  # rejected drafts' KV stays in the pages and is overwritten later
            self.scheduler.register_full_blocks(seq)
            self.scheduler.trim_window(seq)
        spec.accepted_in(seq, old_len, n_acc_i, k)
        return True

    # ---------------------------------------------------------------- offline API
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        from tqdm import tqdm

        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise LmforgeError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not progress) as bar:
            while self.has_unfinished():
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]


def _top_logprobs(
    lp: torch.Tensor, params: Sequence[SamplingParams]
) -> list[dict[int, float] | None]:
    """Per row of lp (R, V), the request's top-n alternatives (None where not asked for)."""
    tops: list[dict[int, float] | None] = [None] * len(params)
    want = max((p.logprobs or 0) for p in params)
    if want:
        tv, ti = lp.topk(want, dim=-1)
        tv_l, ti_l = tv.tolist(), ti.tolist()
        for j, p in enumerate(params):
            if p.logprobs:
                tops[j] = dict(zip(ti_l[j][: p.logprobs], tv_l[j][: p.logprobs], strict=True))
    return tops


def _hybrid_memory(runner: ModelRunner, cfg: Any, window: int | None) -> str:
    """The startup line's memory part for a hybrid layer pattern: KV bytes per token (the paged
    cache holds pages for the K/V layers only) and recurrent-state bytes per sequence (constant
    in its length), and which serving choices the pattern forces."""
    from lmforge.serve.model_runner import kv_bytes_per_block

    kv = kv_bytes_per_block(runner.model, runner.block_size, runner.kv_dtype) // runner.block_size
    parts = [f"layers {cfg.layers!r}: KV {kv} B per token"]
    if runner.states is not None:
        per = runner.states.bytes_per_slot()
        parts.append(
            f"recurrent state {per} B per sequence ({runner.states.num_slots} slots, "
            "prefix cache off: states are recomputed)"
        )
    if "W" in cfg.layer_types:
        if window:
            kept = "blocks behind each window given back"
        else:  # beside A/S layers: rings of R blocks a sequence, in the state slots
            ring = runner.states.ring_blocks * runner.block_size  # type: ignore[union-attr]
            kept = f"W layers' K/V in a {ring}-token ring per sequence"
        parts.append(f"window {cfg.window} ({kept})")
    if "S" in cfg.layer_types:
        index = cfg.layer_types.count("S") * cfg.dsa_index_dim * runner.kv_dtype.itemsize
        parts.append(f"DSA top-{cfg.dsa_topk} (indexer keys {index} B of the KV per token)")
    return ", ".join(parts)


class QueueFull(LmforgeError):
    """The engine's waiting queue is at ``max_queue`` (the server answers 429)."""


def _speculative(spec: Any, model: nn.Module) -> Speculative:
    """``Engine(speculative=)`` as a :class:`~lmforge.serve.speculative.Speculative` (a bare
    proposer gets the default k), attached to the engine's model."""
    from lmforge.serve.speculative import DraftModel, MTPDraft, NgramDraft, Speculative

    if isinstance(spec, NgramDraft | DraftModel | MTPDraft):
        spec = Speculative(spec)
    if not isinstance(spec, Speculative):
        raise LmforgeError(
            "speculative must be an NgramDraft, a DraftModel, an MTPDraft or a Speculative,"
            f" got {spec!r}"
        )
    vocab_size = model.config.vocab_size
    if isinstance(spec.draft, DraftModel) and spec.draft.model.config.vocab_size != vocab_size:
        raise LmforgeError("the draft model's vocabulary differs from the target's")
    spec.attach(model)
    return spec
