"""Rollouts: batched KV-cache sampling with per-token log-probs and policy versions.

The data types follow the inference-engine contract of ``lmforge.serve.engine`` (same names and
fields) so the RL loops run on either: :class:`LocalEngine` here (CPU or one GPU, any token-ids
→ logits module), or :func:`make_engine` wrapping ``lmforge.serve.engine.Engine`` when that
package is importable.

Log-prob semantics (the RL losses depend on it): ``logprobs[i] = log_softmax(logits /
T)[token_i]`` over the full vocabulary in float32, T the request's temperature (1 for greedy),
computed before any top-k / top-p / min-p truncation — exactly what
:func:`lmforge.posttrain.core.token_logprobs` computes in the trainer, so at learning rate 0
every importance ratio is 1 (up to KV-cache vs full-forward rounding; tested).

In-flight weight updates: :class:`Decoding` advances a batch one token per :meth:`~Decoding.step`;
between two steps :meth:`LocalEngine.update_weights` copies new weights into the model in place
and bumps the policy version; the KV cache (keys/values computed by the older weights) is kept,
as PipelineRL does, and each token records the version that sampled it.

Shape legend: B batch (rows), T tokens, S cache slots, V vocab.
Exercised by ``pytest tests/test_posttrain_rl.py -k rollout``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lmforge.posttrain.core import is_lmforge_model
from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request (the engine contract's fields)."""

    temperature: float = 1.0
    "softmax temperature; 0 = greedy"
    top_k: int = 0
    "keep the k most likely tokens (0 = off)"
    top_p: float = 1.0
    "keep the smallest set reaching this probability mass (1 = off)"
    min_p: float = 0.0
    "drop tokens below min_p × the top token's probability (0 = off)"
    max_tokens: int = 16
    "most new tokens"
    n: int = 1
    "completions per prompt"
    seed: int | None = None
    "random seed of this request (None = torch's global RNG)"
    stop_token_ids: Sequence[int] = ()
    "tokens that end a completion (kept as its last token)"
    logprobs: int | None = None
    "top-n alternatives per token (None = off)"
    ignore_eos: bool = False
    "keep going past stop tokens"


@dataclasses.dataclass
class CompletionOutput:
    """One sampled continuation."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: Literal["stop", "length"] | None
    top_logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    """A prompt and its completions (n of them)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


def sampling_scores(
    logits: torch.Tensor, temps: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs for the contract (B, V) and truncated sampling scores (B, V) from logits (B, V).

    ``temps`` (B,) holds each row's temperature with greedy rows at 1.
    """
    scores = logits.float() / temps[:, None]  # (B, V)
    logp = torch.log_softmax(scores, dim=-1)  # (B, V) the recorded distribution
    out = scores.clone()
    for row, p in enumerate(params):
        s = out[row]
        if p.top_k and 0 < p.top_k < s.numel():
            kth = s.topk(p.top_k).values[-1]
            s.masked_fill_(s < kth, float("-inf"))
        if p.min_p > 0:
            probs = torch.softmax(s, -1)
            s.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            sorted_s, order = s.sort(descending=True)
            probs = torch.softmax(sorted_s, -1)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            s.masked_fill_(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logp, out


class _Model:
    """One decode interface over lmforge models (``KVCache``) and transformers models
    (``past_key_values`` with an attention mask and explicit positions)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.lmforge = is_lmforge_model(model)

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, max_new: int) -> torch.Tensor:
        """Left-padded prompts (B, T) with validity (B, T) -> last-position logits (B, V)."""
        if self.lmforge:
            from lmforge.model import KVCache

            self.cache: Any = KVCache.for_model(self.model, ids.shape[0], ids.shape[1] + max_new)
            return self.model(ids, kv_cache=self.cache, valid_mask=valid)[:, -1]
        self.attn = valid.long()  # (B, S)
        self.next_pos = valid.long().sum(-1)  # (B,)
        pos = (valid.long().cumsum(-1) - 1).clamp_min(0)  # (B, T)
        out = self.model(input_ids=ids, attention_mask=self.attn, position_ids=pos, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]

    def decode(self, token: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """One new token per row (B,), rows that stopped marked not alive -> logits (B, V)."""
        if self.lmforge:
            return self.model(token[:, None], kv_cache=self.cache, valid_mask=alive[:, None])[:, -1]
        self.attn = torch.cat([self.attn, alive.long()[:, None]], dim=1)  # (B, S+1)
        pos = self.next_pos[:, None]  # (B, 1)
        self.next_pos = self.next_pos + alive.long()
        out = self.model(
            input_ids=token[:, None],
            attention_mask=self.attn,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1]


class Decoding:
    """A batch of requests being decoded in lockstep, one token per :meth:`step`."""

    def __init__(
        self,
        engine: LocalEngine,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
    ) -> None:
        self.engine = engine
        self.params = list(params)
        self.prompts = [list(p) for p in prompts]
        self.request_ids = list(request_ids)
        device = engine.device
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        self.max_new = max(p.max_tokens for p in params)
        ids = torch.zeros(b, longest, dtype=torch.long, device=device)  # (B, T)
        valid = torch.zeros(b, longest, dtype=torch.bool, device=device)  # (B, T)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[row, longest - len(p) :] = True
        self.temps = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], device=device
        )
        self.greedy = torch.tensor([p.temperature <= 0 for p in params], device=device)
        seed = params[0].seed
        self.gen: torch.Generator | None = None
        if seed is not None:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.logprobs: list[list[float]] = [[] for _ in prompts]
        self.versions: list[list[int]] = [[] for _ in prompts]
        self.top: list[list[dict[int, float]]] = [[] for _ in prompts]
        self.finish: list[str | None] = [None] * b
        self.alive = torch.ones(b, dtype=torch.bool, device=device)
        self._m = _Model(engine.model)
        with torch.inference_mode():
            self.logits = self._m.prefill(ids, valid, self.max_new)  # (B, V)
        # The version of the weights that computed self.logits: a token is recorded with the
        # policy that produced its distribution, not with whatever version is current when it is
        # drawn (a swap between the forward and the draw would otherwise mislabel it).
        self.logits_version = engine.version

    @property
    def done(self) -> bool:
        """Whether every row has finished."""
        return not bool(self.alive.any())

    @torch.inference_mode()
    def step(self) -> None:
        """Sample one token for every live row (recording log-prob and policy version), then
        run the model on it, unless every row is finished."""
        if self.done:
            return
        logits = self.logits
        limit = self.engine.vocab_limit
        if limit is not None and logits.shape[-1] > limit:
            logits = logits.clone()
            logits[:, limit:] = float("-inf")
        logp, scores = sampling_scores(logits, self.temps, self.params)  # (B, V), (B, V)
        probs = torch.softmax(scores, -1)
        sampled = torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)  # (B,)
        token = torch.where(self.greedy, logits.argmax(-1), sampled)  # (B,)
        chosen = logp.gather(-1, token[:, None]).squeeze(-1)  # (B,)
        version = self.logits_version
        for row in self.alive.nonzero().flatten().tolist():
            p = self.params[row]
            tok = int(token[row])
            self.tokens[row].append(tok)
            self.logprobs[row].append(float(chosen[row]))
            self.versions[row].append(version)
            if p.logprobs:
                vals, idx = logp[row].topk(p.logprobs)
                self.top[row].append(dict(zip(idx.tolist(), vals.tolist())))
            stops = set(p.stop_token_ids) | self.engine.eos_ids
            if not p.ignore_eos and tok in stops:
                self.finish[row] = "stop"
            elif len(self.tokens[row]) >= p.max_tokens:
                self.finish[row] = "length"
            if self.finish[row] is not None:
                self.alive[row] = False
        if not self.done:
            self.logits_version = self.engine.version
            self.logits = self._m.decode(token, self.alive)

    def outputs(self) -> list[RequestOutput]:
        """The rows as :class:`RequestOutput` (one completion each)."""
        out = []
        for row in range(len(self.prompts)):
            comp = CompletionOutput(
                self.tokens[row],
                self.logprobs[row],
                self.versions[row],
                self.finish[row],  # type: ignore[arg-type]
                self.top[row] if self.params[row].logprobs else None,
            )
            out.append(
                RequestOutput(
                    self.request_ids[row], self.prompts[row], [comp], self.finish[row] is not None
                )
            )
        return out


class LocalEngine:
    """The rollout engine of this package: batched lockstep KV-cache decoding on one device.

    ``model`` is any token-ids → logits module (lmforge or transformers); ``eos_ids`` end every
    request (unless ``ignore_eos``); ``vocab_limit`` masks ids at or above it (padded vocabularies).
    Simplification: no paging or continuous batching — a batch runs until its last row stops.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_ids: Iterable[int] = (),
        vocab_limit: int | None = None,
    ) -> None:
        self.model = model
        self.eos_ids = set(eos_ids)
        self.vocab_limit = vocab_limit
        self.version = 0
        self._ids = itertools.count()
        self._params = dict(model.named_parameters(remove_duplicate=False))

    @property
    def device(self) -> torch.device:
        """Where the model lives."""
        return next(self.model.parameters()).device

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> Decoding:
        """A :class:`Decoding` of the prompts (each repeated ``n`` times), prefilled."""
        if not prompts:
            raise LmforgeError("no prompts to generate from")
        if any(len(p) == 0 for p in prompts):
            raise LmforgeError("every prompt needs at least one token")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise LmforgeError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        rows, row_params, ids = [], [], []
        for p, sp in zip(prompts, plist):
            rid = str(next(self._ids))
            for _ in range(sp.n):
                rows.append(p)
                row_params.append(dataclasses.replace(sp, n=1))
                ids.append(rid)
        ctx = getattr(getattr(self.model, "config", None), "context_length", None)
        longest = max(len(p) for p in rows) + max(sp.max_tokens for sp in row_params)
        if ctx is not None and longest > ctx:
            raise LmforgeError(f"prompt + max_tokens ({longest}) exceeds the context ({ctx})")
        return Decoding(self, rows, row_params, ids)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[RequestOutput]:
        """Sample every prompt to completion; a prompt with ``n > 1`` gives one
        :class:`RequestOutput` holding its n completions, in prompt order."""
        dec = self.start(prompts, params)
        while not dec.done:
            dec.step()
        merged: dict[str, RequestOutput] = {}
        for out in dec.outputs():
            if out.request_id in merged:
                merged[out.request_id].outputs.extend(out.outputs)
            else:
                merged[out.request_id] = out
        return list(merged.values())

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy new weights into the model in place (running decodes keep their KV cache)."""
        for name, value in named_tensors:
            if name not in self._params:
                raise LmforgeError(f"update_weights: the engine's model has no parameter {name!r}")
            self._params[name].copy_(value)
        self.version = version


ROLLOUT_KV_FRACTION = 0.3
"Share of the free device memory a rollout engine's KV cache may take: the trainer shares the GPU."


def rollout_kv_blocks(
    context_length: int,
    bytes_per_block: int,
    free_bytes: int,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    fraction: float = ROLLOUT_KV_FRACTION,
) -> int:
    """KV blocks for a rollout engine that shares its device with a trainer.

    Enough for ``max_num_seqs`` full contexts (more only helps the prefix cache), capped at
    ``fraction`` of ``free_bytes``; at least one full context (the engine refuses less). A
    serving engine takes most of the free memory instead; here the trainer's reference model,
    optimizer state and activations are allocated after the engine, so it must leave them room.
    """
    per_seq = -(-context_length // block_size)
    cap = int(fraction * free_bytes) // max(bytes_per_block, 1)
    return max(per_seq, min(max_num_seqs * per_seq, cap))


def make_engine(model: nn.Module, eos_ids: Iterable[int] = (), prefer: str = "auto") -> Any:
    """The rollout engine: ``lmforge.serve.engine.Engine`` when importable and ``prefer`` is
    ``auto`` or ``serve``, else :class:`LocalEngine`.

    Both answer ``generate(prompts, params)`` and ``update_weights(named, version)``; the serve
    engine takes its own ``SamplingParams`` (same fields), which :func:`to_serve_params` builds.
    On CUDA its KV cache is sized by :func:`rollout_kv_blocks` (the trainer needs the rest).
    """
    if prefer in ("auto", "serve"):
        try:
            from lmforge.serve.engine import Engine  # noqa: F401
        except ImportError:
            if prefer == "serve":
                raise LmforgeError(
                    "lmforge.serve.engine is not available in this checkout"
                ) from None
        else:
            return _ServeAdapter(model, set(eos_ids))
    return LocalEngine(model, eos_ids=eos_ids)


class _ServeAdapter:
    """``lmforge.serve.engine.Engine`` behind this module's types (fields copied one to one).

    The serve engine holds the same module (no copy), so a trainer stepping that module only
    has to bump :attr:`version`, which sets the serve engine's ``policy_version``.
    """

    def __init__(self, model: nn.Module, eos_ids: set[int]) -> None:
        from lmforge.serve.engine import Engine
        from lmforge.serve.runner import PagedKVCache

        param = next(model.parameters())
        num_blocks = None
        if param.device.type == "cuda":
            per_block = PagedKVCache.bytes_per_block(model, 16, param.dtype)
            free = int(torch.cuda.mem_get_info(param.device)[0])
            num_blocks = rollout_kv_blocks(model.config.context_length, per_block, free)
        # CUDA graphs on a GPU: a small model's decode step is launch-bound without them; the
        # trainer updates the weights in place, so the captured graphs read the new ones.
        self.engine = Engine(model, device=param.device, block_size=16, num_blocks=num_blocks,
                             cuda_graphs=param.device.type == "cuda")  # fmt: skip
        self.eos_ids = eos_ids

    @property
    def version(self) -> int:
        """The policy version the next tokens are recorded with."""
        return int(self.engine.policy_version)

    @version.setter
    def version(self, value: int) -> None:
        self.engine.policy_version = int(value)

    def _serve_params(self, params: SamplingParams | Sequence[SamplingParams], n: int) -> list[Any]:
        from lmforge.serve.engine import SamplingParams as ServeParams

        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise LmforgeError(f"{len(plist)} sampling params for {n} prompts")
        conv = []
        for p in plist:
            fields = dataclasses.asdict(p)
            fields["stop_token_ids"] = tuple(set(p.stop_token_ids) | self.eos_ids)
            conv.append(ServeParams(**fields))
        return conv

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Sample every prompt to completion (n completions per prompt), in prompt order."""
        conv = self._serve_params(params, len(prompts))
        outs = self.engine.generate([list(p) for p in prompts], conv)
        return [_local_output(o) for o in outs]

    def start(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> _ServeDecoding:
        """The prompts queued on the serve engine, stepped by the caller (``LocalEngine.start``'s
        interface: ``done``, ``step()``, ``outputs()`` with one row per sample): the Pipeline RL
        engine swaps weights in between two steps."""
        conv = self._serve_params(params, len(prompts))
        ids = [self.engine.add_request(list(p), sp) for p, sp in zip(prompts, conv, strict=True)]
        return _ServeDecoding(self.engine, ids)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        self.engine.update_weights(named_tensors, version)


def _local_output(o: Any) -> RequestOutput:
    """A serve-engine ``RequestOutput`` as this module's type (fields copied one to one)."""
    comps = [
        CompletionOutput(
            list(c.token_ids),
            list(c.logprobs),
            list(c.policy_versions),
            c.finish_reason,
            c.top_logprobs,
        )
        for c in o.outputs
    ]
    return RequestOutput(o.request_id, list(o.prompt_token_ids), comps, o.finished)


class _ServeDecoding:
    """Requests on the serve engine stepped by the caller, with :class:`Decoding`'s interface."""

    def __init__(self, engine: Any, request_ids: Sequence[str]) -> None:
        self.engine = engine
        self.request_ids = list(request_ids)
        self.finished: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        """Whether every request has finished."""
        return len(self.finished) == len(self.request_ids)

    def step(self) -> None:
        """One engine step (it may also advance other requests queued on the same engine)."""
        for out in self.engine.step():
            if out.finished and out.request_id in self.request_ids:
                self.finished[out.request_id] = out

    def outputs(self) -> list[RequestOutput]:
        """One :class:`RequestOutput` per sample (a prompt with n > 1 gives n rows), in order."""
        rows = []
        for rid in self.request_ids:
            o = _local_output(self.finished[rid])
            rows += [RequestOutput(o.request_id, o.prompt_token_ids, [c], True) for c in o.outputs]
        return rows


# ---------------------------------------------------------------------------------------------
# The one engine


def _kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    # keys and values of every layer for one block of tokens
    cfg = model.config
    kv_heads = getattr(cfg, "n_kv_heads", None) or cfg.n_heads
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_heads)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.n_layers * kv_heads * head_dim * block_size * itemsize


def rollout_engine(model: nn.Module, eos_ids: Iterable[int] = (), seed: int = 0) -> Any:
    """A :class:`lmforge.serve.Engine` sampling from ``model`` itself (no copy: the trainer
    updates the weights in place and bumps the engine's ``policy_version`` with
    ``update_weights({}, version)``). On CUDA the KV cache is sized by :func:`rollout_kv_blocks`
    (the trainer needs the rest of the memory) and decode runs through CUDA graphs, which read
    the updated weights in place. Requests pass ``stop_token_ids``; the engine's own EOS is the
    first of ``eos_ids``."""
    from lmforge.serve import Engine

    if not is_lmforge_model(model):
        raise LmforgeError(
            "rollouts run on lmforge.serve.Engine, which needs an lmforge model (a checkpoint, "
            "GGUF or HF import), not a transformers module"
        )
    param = next(model.parameters())
    eos = list(eos_ids)
    num_blocks = None
    cuda = param.device.type == "cuda"
    if cuda:
        per_block = _kv_bytes_per_block(model, 16, param.dtype)
        free = int(torch.cuda.mem_get_info(param.device)[0])
        num_blocks = rollout_kv_blocks(model.config.context_length, per_block, free)
    return Engine(model, device=param.device, block_size=16, num_blocks=num_blocks,
                  eos_token_id=eos[0] if eos else None, seed=seed,
                  cuda_graphs=cuda)  # fmt: skip
