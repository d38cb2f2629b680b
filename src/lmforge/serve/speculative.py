"""Speculative decoding: a draft proposes k tokens, the target checks them in one forward.

Drafts: a small lmforge model (:class:`DraftModel`) — e.g. :func:`truncated_draft`, the target's
own first layers + final norm + LM head (a "self-speculative" draft that needs no other
weights) — or prompt lookup (:class:`NgramDraft`: the tokens that followed the last occurrence
of the sequence's trailing n-gram, a deterministic draft whose q is one-hot). ``draft=None`` is
plain decoding on the same runner, one target forward per token: the peer a speedup is
measured against (``benchmarks/speculative.py``).

Exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023), :func:`verify`: for draft
token x_i drawn from q_i, accept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
rejection draw the replacement from ``norm(max(0, p_i − q_i))`` and stop; if all k are accepted,
draw a bonus token from ``p_k``. Every emitted token is then distributed exactly as the target's
``p`` (the sampling distribution after temperature and truncation), whatever q is. Greedy is the
special case p, q = one-hot argmax: accept while the draft equals the target's argmax, so the
output is token-identical to plain greedy decoding.

Simplification: one sequence at a time (the batch-1 latency case the technique is for), on the
engine's paged runner with a private block table per model; rejected positions' KV is simply
overwritten later. Reported logprobs follow the engine's contract (target ``log_softmax(logits /
T)`` of each emitted token). Exercised by ``pytest tests/test_serve_speculative.py
tests/test_serve_spec_drafts.py``; measured by ``benchmarks/speculative.py``.

Shape legend: B rows (independent trials), k draft length, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from lmforge.serve.engine import CompletionOutput
from lmforge.serve.runner import PagedKVCache, StepBatch, forward_step
from lmforge.serve.sampling import SamplingParams, truncated_probs
from lmforge.utils.errors import LmforgeError

__all__ = [
    "DraftModel",
    "NgramDraft",
    "SpecStats",
    "SpeculativeDecoder",
    "truncated_draft",
    "verify",
]


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample B rows of k draft tokens: ``(n_accepted (B,), next token (B,))``.

    p (B, k+1, V) target probabilities (row i: after the prefix and drafts < i), q (B, k, V) the
    draft's, draft (B, k) long. Row b emits ``draft[b, :n_accepted[b]]`` then its next token.
    Vectorised over rows (the χ² test draws 10⁵ of them at once).
    """
    b, k, _ = q.shape
    px = p[:, :k].gather(2, draft[..., None])[..., 0]  # (B, k)
    qx = q.gather(2, draft[..., None])[..., 0]  # (B, k)
    u = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    ok = u * qx < px  # u < p/q without dividing by a zero q
    n_acc = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) accepted before the first rejection
    pad_q = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # (B, k+1, V): q_k = 0 -> bonus
    rows = torch.arange(b, device=p.device)
    residual = (p[rows, n_acc] - pad_q[rows, n_acc]).clamp_min(0)  # (B, V)
    mass = residual.sum(-1, keepdim=True)
    # p == q at a rejected position has zero residual mass, yet was rejected with probability 0;
    # guard the division anyway (fall back to p).
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[rows, n_acc])
    nxt = torch.multinomial(residual, 1, generator=generator)[:, 0]  # (B,)
    return n_acc, nxt


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
        cfg = model.config
        self.model = model
        self.bs = block_size
        nb = math.ceil(max_len / block_size) + 1
        self.cache = PagedKVCache(
            cfg.n_layers, nb, block_size, cfg.kv_heads, cfg.head_dim, param.device, param.dtype
        )
        self.table = list(range(nb))
        self.device = param.device
        self.n_cached = 0

    def feed(self, tokens: Sequence[int], all_logits: bool) -> torch.Tensor:
        """Run ``tokens`` after the cached prefix; logits of every fed token or of the last."""
        n, start = len(tokens), self.n_cached
        end = start + n
        dev = self.device
        pos = torch.arange(start, end, device=dev)
        slots = torch.tensor(
            [self.table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)],
            device=dev,
        )
        width = math.ceil(end / self.bs)
        rows = torch.arange(n, device=dev) if all_logits else torch.tensor([n - 1], device=dev)
        batch = StepBatch(
            tokens=torch.tensor(list(tokens), dtype=torch.long, device=dev),
            positions=pos,
            slots=slots,
            block_tables=torch.tensor([self.table[:width]], dtype=torch.int32, device=dev),
            ctx_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            last_rows=rows,
            q_lens=[n],
            ctx_lens_list=[end],
            tables_list=[self.table[:width]],
        )
        self.n_cached = end
        return forward_step(self.model, self.cache, batch)  # (n or 1, V)


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
    """Counts of one generation: drafted and accepted tokens, target forwards."""

    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    "target forwards after the prefill (each verifies the drafts and emits >= 1 token)"
    draft_steps: int = 0
    "draft-model forwards after the prefill (0 for n-gram drafting)"
    emitted: int = 0
    "tokens generated"
    prefill_seconds: float = 0.0
    "wall time of the prompt prefills (target and draft), so a benchmark can report decode alone"
    prefill_cpu_seconds: float = 0.0
    "the same in this process's CPU time (a clock that other processes' load barely moves)"

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward (1 for plain decoding; at most k + 1)."""
        return self.emitted / self.target_steps if self.target_steps else 0.0


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, V) logits -> the distributions a request samples from (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    lp = torch.log_softmax(logits.float() / params.temperature, -1)
    return torch.stack([truncated_probs(row, params) for row in lp])


class SpeculativeDecoder:
    """Batch-1 speculative decoding of a target model with a draft model or n-gram lookup.

    ``draft=None`` decodes plainly (one token per target forward, ``k`` ignored).
    """

    def __init__(
        self,
        target: nn.Module,
        draft: DraftModel | NgramDraft | None,
        k: int = 4,
        eos_token_id: int | None = None,
        block_size: int = 16,
    ) -> None:
        if draft is None:
            k = 0
        elif k < 1:
            raise LmforgeError(f"speculative k must be >= 1, got {k}")
        self.target, self.draft, self.k = target, draft, k
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        if (
            isinstance(draft, DraftModel)
            and draft.model.config.vocab_size != target.config.vocab_size
        ):
            raise LmforgeError("the draft model's vocabulary differs from the target's")
        self.stats = SpecStats()

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], params: SamplingParams) -> CompletionOutput:
        """One sample for ``prompt`` (``params.n`` must be 1)."""
        if params.n != 1:
            raise LmforgeError("speculative decoding serves one sample per request (n = 1)")
        ctx = self.target.config.context_length
        tokens = [int(t) for t in prompt]
        if not tokens or len(tokens) >= ctx:
            raise LmforgeError(f"the prompt needs 1 to {ctx - 1} tokens")
        max_len = min(len(tokens) + params.max_tokens + self.k + 1, ctx + self.k + 1)
        tgt = _Paged(self.target, max_len, self.block_size)
        drf = None
        if isinstance(self.draft, DraftModel):
            drf = _Paged(self.draft.model, max_len, self.block_size)
        gen = None
        device = tgt.device
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
        out = CompletionOutput([], [], [], None)
        temp = params.temperature if params.temperature > 0 else 1.0
        # Prefill all but the last token; the loop always feeds the last token first.
        t0, c0 = time.perf_counter(), time.process_time()
        if len(tokens) > 1:
            tgt.feed(tokens[:-1], all_logits=False)
            if drf is not None:
                drf.feed(tokens[:-1], all_logits=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # else the prefill's time lands in the first step
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_cpu_seconds += time.process_time() - c0
        while out.finish_reason is None:
            room = min(params.max_tokens - len(out.token_ids), ctx - len(tokens))
            k = max(0, min(self.k, room - 1))
            drafts, q_rows = self._propose(tokens, k, drf, params, gen)
            k = len(drafts)
            logits = tgt.feed([tokens[-1], *drafts], all_logits=True)  # (k+1, V)
            self.stats.target_steps += 1
            p = _probs(logits, params)  # (k+1, V)
            if k:
                q = torch.stack(q_rows)[None]  # (1, k, V)
                n_acc, nxt = verify(p[None], q, torch.tensor([drafts], device=device), gen)
                n_acc_i, nxt_i = int(n_acc[0]), int(nxt[0])
            else:
                n_acc_i = 0
                nxt_i = int(torch.multinomial(p[0], 1, generator=gen)[0])
            self.stats.drafted += k
            self.stats.accepted += n_acc_i
            emitted = [*drafts[:n_acc_i], nxt_i]
            lps = torch.log_softmax(logits.float() / temp, -1)  # (k+1, V)
            old_len = len(tokens)
            for j, tok in enumerate(emitted):
                tokens.append(tok)
                self.stats.emitted += 1
                out.token_ids.append(tok)
                out.logprobs.append(float(lps[j, tok]))
                out.policy_versions.append(0)
                if tok in params.stop_token_ids or (
                    not params.ignore_eos and tok == self.eos_token_id
                ):
                    out.finish_reason = "stop"
                elif len(out.token_ids) >= params.max_tokens or len(tokens) >= ctx:
                    out.finish_reason = "length"
                if out.finish_reason is not None:
                    break
            # KV of the rejected drafts stays in the pages and is overwritten later.
            tgt.n_cached = len(tokens) - 1
            if drf is not None:
                drf.n_cached = min(drf.n_cached, old_len + min(n_acc_i, max(k - 1, 0)))
        return out

    def _propose(
        self,
        tokens: list[int],
        k: int,
        drf: _Paged | None,
        params: SamplingParams,
        gen: torch.Generator | None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        if k == 0 or self.draft is None:
            return [], []
        if drf is None:
            assert isinstance(self.draft, NgramDraft)
            drafts = self.draft.propose(tokens, k)
            if not drafts:
                return [], []
            vocab = self.target.config.vocab_size
            device = next(self.target.parameters()).device
            # one-hot rows (k, V), not a (V, V) identity: 49,152² floats would be 9.7 GB.
            q = nn.functional.one_hot(torch.tensor(drafts, device=device), vocab).float()
            return drafts, list(q)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        feed = tokens[drf.n_cached :]  # catch up on what the target accepted
        for _ in range(k):
            logits = drf.feed(feed, all_logits=False)  # (1, V)
            self.stats.draft_steps += 1
            q = _probs(logits, params)[0]  # (V,)
            tok = (
                int(torch.multinomial(q, 1, generator=gen)[0])
                if not params.greedy
                else int(q.argmax())
            )
            drafts.append(tok)
            qs.append(q)
            feed = [tok]
        return drafts, qs
