"""Speculative decoding, a mode of the engine: a proposer drafts k tokens, the target checks
them in one forward.

``Engine(model, speculative=Speculative(draft, k))`` (:class:`Speculative`). Proposers: a small
lmforge model (:class:`DraftModel`) — e.g. :func:`truncated_draft`, the target's own first
layers + final norm + LM head (a "self-speculative" draft that needs no other weights) — or
prompt lookup (:class:`NgramDraft`: the tokens that followed the last occurrence of the
sequence's trailing n-gram, a deterministic draft whose q is one-hot) — or the target's own
multi-token-prediction modules (:class:`~lmforge.model.mtp.MTPDraft`, ``--speculative mtp``:
greedy drafts, q one-hot, from the target's final hidden states of the sequence, which
:class:`_HiddenTap` keeps by position as the engine's forwards compute them).

Exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023), :func:`verify`: for draft
token x_i drawn from q_i, accept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
rejection draw the replacement from ``norm(max(0, p_i − q_i))`` and stop; if all k are accepted,
draw a bonus token from ``p_k``. Every emitted token is then distributed exactly as the target's
``p`` (the sampling distribution after temperature and truncation), whatever q is. Greedy is the
special case p, q = one-hot argmax: accept while the draft equals the target's argmax, so the
output is token-identical to plain greedy decoding.

Simplification: the engine serves one sequence at a time in this mode (the batch-1 latency
case the technique is for; n > 1 is refused); the target's verify forward is the engine's own
step over its paged cache (rejected positions' KV is simply overwritten later): k + 1 one-token
decode rows over the sequence's block table, so it runs compiled and in CUDA graphs like a
plain decode step (:func:`~lmforge.serve.step.as_decode_rows`; the engine captures graphs up
to k + 1 rows for it, ``ModelRunner(max_decode_rows=)``); the draft model keeps a private paged
cache (:class:`_Paged`); an MTP proposal is one captured program too (:class:`MTPDraft`: one
replay and one host read per proposal in the steady state). Reported logprobs follow the engine's
contract (target ``log_softmax(logits / T)`` of each emitted token). Exercised by ``pytest
tests/test_serve_speculative.py tests/test_serve_spec_drafts.py``; measured by
``benchmarks/speculative.py``.

Shape legend: B rows (independent trials), k draft length, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.model.mtp import MTPDraft, step_cache
from lmforge.serve.model_runner import forward_step, new_kv_cache, stage
from lmforge.serve.sampling import SamplingParams, truncated_probs
from lmforge.serve.scheduler import StepInputs
from lmforge.utils.errors import LmforgeError

__all__ = [
    "DraftModel",
    "MTPDraft",
    "NgramDraft",
    "SpecStats",
    "Speculative",
    "truncated_draft",
    "verify",
]


def verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample B rows of k draft tokens: ``(n_accepted (B,), next token (B,))``.

    p (B, k+1, V) target probabilities (row i: after the prefix and drafts < i), q (B, k, V) the
    draft's, or None for one-hot drafts (q(x) = 1 at the draft: the n-gram and MTP proposers,
    computed without building q), draft (B, k) long. Row b emits ``draft[b, :n_accepted[b]]``
    then its next token. Vectorised over rows (the χ² test draws 10⁵ of them at once). With
    q None the draws are those of the explicit one-hot q, bit for bit (same random numbers, same
    residual values).
    """
    b, k = draft.shape
    px = p[:, :k].gather(2, draft[..., None])[..., 0]  # (B, k)
    u = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    if q is None:
        ok = u < px  # u · 1 < p(x)
    else:
        ok = u * q.gather(2, draft[..., None])[..., 0] < px  # u < p/q without dividing by 0
    n_acc = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) accepted before the first rejection
    rows = torch.arange(b, device=p.device)
    target = p[rows, n_acc]  # (B, V)
    if q is None:  # p minus the one-hot draft, clamped: the draft's entry zeroed (bonus row: p)
        at = draft.gather(1, n_acc.clamp_max(k - 1)[:, None])  # (B, 1)
        keep = torch.where(n_acc[:, None] < k, 0.0, target.gather(1, at))
        residual = target.scatter(1, at, keep.to(target.dtype))
    else:
        pad_q = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # (B, k+1, V): q_k = 0: bonus
        residual = (target - pad_q[rows, n_acc]).clamp_min(0)  # (B, V)
    mass = residual.sum(-1, keepdim=True)
    # p == q at a rejected position has zero residual mass, yet was rejected with probability 0;
    # guard the division anyway (fall back to p).
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target)
    nxt = torch.multinomial(residual, 1, generator=generator)[:, 0]  # (B,)
    return n_acc, nxt


def verify_greedy(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for a greedy request, from the target's (k+1, V) logits and the (k,)
    drafts: its distribution is one-hot at the argmax, so a draft is accepted while it equals
    the argmax and the next token is the argmax after the last accepted one (what ``verify``
    computes from the one-hot rows, without the vocabulary-wide tensors or random draws).
    Returns ``(n_accepted (1,), next token (1,))``."""
    best = logits.argmax(-1)  # (k+1,)
    n_acc = (best[:-1] == draft).long().cumprod(0).sum(0, keepdim=True)  # (1,)
    return n_acc, best.index_select(0, n_acc)


class NgramDraft:
    """Prompt-lookup drafting: continue the last earlier occurrence of the trailing n-gram."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens (possibly none) that followed the longest matching n-gram."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            tail = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):
                if list(tokens[start : start + n]) == tail:
                    return list(tokens[start + n : start + n + k])
        return []


class _Paged:
    """One model with a private, contiguous block table for a single sequence."""

    def __init__(self, model: nn.Module, max_len: int, block_size: int = 16) -> None:
        param = next(model.parameters())
        self.model = model
        self.bs = block_size
        nb = math.ceil(max_len / block_size) + 1
        self.cache = new_kv_cache(model, nb, block_size, param.device, param.dtype)
        self.table = list(range(nb))
        self.device = param.device
        self.n_cached = 0

    def feed(self, tokens: Sequence[int], all_logits: bool) -> torch.Tensor:
        """Run ``tokens`` after the cached prefix; logits of every fed token or of the last."""
        n, start = len(tokens), self.n_cached
        end, bs = start + n, self.bs
        slots = [self.table[p // bs] * bs + p % bs for p in range(start, end)]
        rows = list(range(n)) if all_logits else [n - 1]
        table = self.table[: math.ceil(end / bs)]
        step = StepInputs(list(tokens), list(range(start, end)), slots, rows, [n], [end], [table])
        self.n_cached = end
        return forward_step(self.model, self.cache, stage(step, self.device))  # (n or 1, V)


class _HiddenTap:
    """The target's final hidden states (``final_hidden``, (P, D)) of every token its engine
    steps feed, stored by position: a forward hook on the last block reads the step's context.

    Speculative mode serves one sequence at a time, so position p holds the current sequence's
    token p once a forward computed it (rejected drafts' rows are overwritten when the position
    is fed again, like their KV pages). Prefix caching is off with it (a hit would skip the
    forward that fills those rows). The hook writes through ``lmforge_serve::write_rows`` (an
    in-place custom op), so it runs inside the compiled decode step and is recorded by a CUDA
    graph like the KV writes: every step feeds the tap. Graph padding rows (their slots in the
    cache's scratch block, the last one) write to one extra row, never read."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        import lmforge.serve.compiled  # noqa: F401  (registers lmforge_serve::write_rows)

        self.model, self.rows = model, rows
        p = next(model.parameters())
        # (P + 1, D): allocated now, before the engine compiles or captures its decode step
        self.hidden = torch.zeros(rows + 1, model.config.d_model, dtype=p.dtype, device=p.device)
        self.handle = model.layers[-1].register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: Any, kwargs: dict, out: Any) -> None:
        ctx = kwargs.get("context")
        if ctx is None:
            return
        h = self.model.final_hidden(out)[0]  # (1, N, D) -> (N, D)
        pages = ctx.latent_cache if ctx.latent_cache is not None else ctx.k_cache
        nb, bs = pages.shape[1], pages.shape[2]  # (L, NB, BS, ...): block NB - 1 is scratch
        real = ctx.slots < (nb - 1) * bs
        rows = torch.where(real, ctx.positions, self.rows)  # (N,)
        torch.ops.lmforge_serve.write_rows(self.hidden, rows, h)


def mtp_draft_for(model: nn.Module) -> MTPDraft:
    """The target's own MTP modules as a proposer (one line when it has none)."""
    if getattr(model, "mtp", None) is None:
        raise LmforgeError(
            "speculative mtp needs a model with multi-token-prediction modules"
            " (model.mtp_depth > 0)"
        )
    slots = model.config.context_length + 64  # the draft steps' caches (longer: no cache)
    return MTPDraft(model.mtp, model.token_embeddings, model.logits_from_hidden,
                    functools.partial(step_cache, model, slots))  # fmt: skip


@dataclasses.dataclass
class DraftModel:
    """A small model that proposes tokens by sampling its own distribution."""

    model: nn.Module


def truncated_draft(target: nn.Module, n_layers: int, *, share: bool = True) -> nn.Module:
    """The target's first ``n_layers`` blocks + its final norm + its LM head, as a model.

    A self-speculative draft: the same embedding, blocks and head (tied or not), so it needs no
    other weights and speaks the same vocabulary; only the last ``L - n_layers`` blocks are
    skipped. ``share=True`` shares the target's modules (no memory; the target's weights, so it
    must not be trained); ``share=False`` deep-copies them (a draft to fine-tune or distill).
    Its logits equal those of a ``n_layers``-layer TransformerLM holding the same weights
    (``tests/test_serve_spec_drafts.py``).
    """
    from lmforge.model import TransformerLM

    cfg = target.config
    if not isinstance(n_layers, int) or not 1 <= n_layers <= cfg.n_layers:
        raise LmforgeError(f"a truncated draft needs 1 to {cfg.n_layers} layers, got {n_layers!r}")
    draft = TransformerLM(dataclasses.replace(cfg, n_layers=n_layers), device="meta")
    parts = {
        "token_embeddings": target.token_embeddings,
        "layers": nn.ModuleList(list(target.layers)[:n_layers]),
        "ln_final": target.ln_final,
        "lm_head": target.lm_head,
    }
    if not share:
        parts = copy.deepcopy(parts)  # one deepcopy keeps a tied head tied to the embedding
    for name, module in parts.items():
        setattr(draft, name, module)
    return draft.train(target.training)


@dataclasses.dataclass
class SpecStats:
    """Counts of a speculative engine: drafted and accepted tokens, draft-model forwards."""

    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    "draft-model forwards (0 for n-gram drafting)"

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def verify_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, V) logits -> the distributions a request samples from (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    lp = torch.log_softmax(logits.float() / params.temperature, -1)
    return torch.stack([truncated_probs(row, params) for row in lp])


class Speculative:
    """Speculative decoding as a mode of :class:`~lmforge.serve.Engine`: ``Engine(model,
    speculative=Speculative(NgramDraft(), k=4))`` (or a bare proposer, k = 4). The engine then
    serves one sequence at a time (batch 1) and, at each decode step with drafts, verifies up
    to ``k`` of them in one target forward. ``stats`` counts drafted and accepted tokens."""

    def __init__(self, draft: DraftModel | NgramDraft | MTPDraft, k: int = 4) -> None:
        if not isinstance(draft, DraftModel | NgramDraft | MTPDraft):
            raise LmforgeError(
                f"a speculative draft is an NgramDraft, a DraftModel or an MTPDraft, got {draft!r}"
            )
        if not isinstance(k, int) or k < 1:
            raise LmforgeError(f"speculative k must be >= 1, got {k!r}")
        self.draft, self.k = draft, k
        self.stats = SpecStats()
        self._state: tuple[object, _Paged] | None = None  # (sequence, the draft model's cache)
        self.tap: _HiddenTap | None = None  # MTPDraft: the target's hidden states

    def attach(self, target: nn.Module) -> None:
        """Called by the engine with its model: an MTP proposer starts tapping its hidden
        states."""
        if isinstance(self.draft, MTPDraft) and self.tap is None:
            self.tap = _HiddenTap(target, target.config.context_length + self.k + 1)
            self.draft.source = self.tap.hidden  # what a captured proposal reads

    def graphs_default(self, on: bool) -> None:
        """Called by the engine with its CUDA-graph setting: an MTP proposer left to decide
        (``MTPDraft(graphs=None)``) captures its proposals when the engine captures steps."""
        if isinstance(self.draft, MTPDraft) and self.draft.graphs is None:
            self.draft.graphs = on

    def accepted_in(self, seq: object, old_len: int, n_acc: int, k: int) -> None:
        """After a verify: the draft model's cache keeps only KV of accepted tokens."""
        if self._state is not None and self._state[0] is seq:
            drf = self._state[1]
            drf.n_cached = min(drf.n_cached, old_len + min(n_acc, max(k - 1, 0)))

    def _paged(self, seq: object, max_len: int, block_size: int) -> _Paged:
        if self._state is None or self._state[0] is not seq:
            assert isinstance(self.draft, DraftModel)
            self._state = (seq, _Paged(self.draft.model, max_len, block_size))
        return self._state[1]


def propose(
    spec: Speculative,
    seq: Any,
    k: int,
    params: SamplingParams,
    gen: torch.Generator,
    block_size: int,
) -> tuple[list[int] | torch.Tensor, torch.Tensor | None]:
    """Up to k drafts after ``seq.tokens`` and their draft distributions q (k, V); q is None
    for the one-hot proposers (n-gram, MTP: q(x) = 1 at each draft, see :func:`verify`). MTP
    drafts stay on the device ((k,) long, read nothing on the host: ``MTPDraft.propose``'s
    ``on_device``) unless the proposal fell back to the reference."""
    tokens = seq.tokens
    if isinstance(spec.draft, MTPDraft):
        n = len(tokens) - 1  # the target computed tokens[:n]; tokens[n] is its last sample
        if spec.tap is None or n < 1:
            return [], None
        return spec.draft.propose(spec.tap.hidden[:n], tokens, k, key=seq, on_device=True), None
    if isinstance(spec.draft, NgramDraft):
        return spec.draft.propose(tokens, k), None
    ctx = spec.draft.model.config.context_length
    max_len = min(len(tokens) + params.max_tokens + spec.k + 1, ctx + spec.k + 1)
    drf = spec._paged(seq, max_len, block_size)
    drafts: list[int] = []
    qs: list[torch.Tensor] = []
    feed = tokens[drf.n_cached :]  # catch up on what the target accepted
    for _ in range(k):
        logits = drf.feed(feed, all_logits=False)  # (1, V)
        spec.stats.draft_steps += 1
        q = verify_probs(logits, params)[0]  # (V,)
        tok = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=gen)[0])
        drafts.append(tok)
        qs.append(q)
        feed = [tok]
    return drafts, torch.stack(qs)  # (k, V)


def speculative_from_flag(model: nn.Module, flag: str | None, k: int = 4) -> Speculative | None:
    """The engine's speculative mode from a command-line value: ``ngram`` (prompt lookup),
    ``draft:N`` (the target's own first N blocks, :func:`truncated_draft`), ``mtp`` (the
    target's own MTP modules, :func:`mtp_draft_for`) or None/"" (off).
    A bad value or N outside [1, layers) is one :class:`LmforgeError` line."""
    from lmforge.utils.errors import LmforgeError

    if not flag:
        return None
    if k < 1:
        raise LmforgeError(f"--speculative-k must be at least 1, got {k}")
    if flag == "ngram":
        return Speculative(NgramDraft(), k)
    if flag == "mtp":
        return Speculative(mtp_draft_for(model), k)
    n_layers = len(model.layers)
    if flag.startswith("draft:") and flag[6:].isdigit() and 1 <= int(flag[6:]) < n_layers:
        return Speculative(DraftModel(truncated_draft(model, int(flag[6:]))), k)
    raise LmforgeError(
        f"--speculative must be 'ngram' or 'draft:N' with 1 <= N < {n_layers}, or 'mtp'"
        f" (a model with MTP modules), got {flag!r}"
    )
