"""Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules predicting t+2, t+3, …

Module k (1-based) at position i combines the previous depth's representation h^{k-1}_i (depth
0: the main model's last hidden state) with the embedding of token t_{i+k}, and predicts
t_{i+k+1}:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)]      (2D -> D, ``proj``)
    h^k_{0..T-k-1} = TRM_k(h'^k_{0..T-k-1})                         (one causal block)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                           (the main model's head)

The embedding and the output head are the main model's, passed in as callables (shared, as in
the paper); each module owns its two input norms, its projection, its block (built by a factory,
so it is lmforge's :class:`~lmforge.model.TransformerBlock` or any ``block(x, positions)``) and
its output norm. The concatenation order is [embedding ; hidden], the order of DeepSeek-V3's
released weights (``eh_proj``; the paper writes the two the other way round, which is the same
model with the projection's columns swapped), so :mod:`lmforge.hf` maps them without a permute.

Loss: ``L_MTP = λ / D · Σ_k CE(P^k, t_{·+k+1})`` (:func:`mtp_loss`), added to the main loss;
gradients reach the main model through h^0 and the shared embedding/head.

Drafting (:func:`mtp_draft`, :class:`MTPDraft`): after the main model's forward over n tokens
(hidden states h^0_{0..n-1}) and its sampled next token t_n, depth j's output at position n−1
predicts t_{n+j}: the drafter runs the modules in order, feeding each greedy draft as the next
depth's input token. :func:`mtp_draft` recomputes each draft step over all n positions: the
readable reference. :class:`MTPDraft` with a per-sequence ``key`` (the engine's proposer) keeps
one contiguous KV cache and one output buffer per draft step instead: step j's positions
i <= n - j read only committed tokens, so they are final and reused by the next proposal, and
each proposal computes only the positions after them (the newly committed ones and the j - 1
that read drafts), O(accepted + k) rows per step instead of O(n); tested draft-for-draft
against the reference. A proposal is one fixed-shape device program: every step reads its rows'
positions, its tokens and n from device buffers (the drafts are fed to the next step on the
device), so a proposal costs one host read (the k drafts), not one per draft, and in the steady
state (at most 2k rows a step, padded to 2k) it is captured once in a CUDA graph and replayed:
one launch instead of ~150 eager ones (each op of the block) per draft step. Beyond D drafts
the last module is applied again to its own output (as vLLM runs DeepSeek-V3's single MTP
module for k > 1).

Shape legend: B batch, T/n sequence, D model dim, V vocab; k depth.
In the model: ``ModelConfig.mtp_depth`` > 0 builds them as ``TransformerLM.mtp``; the LM loss
(``lmforge.train.loss``) adds :func:`mtp_loss`; the engine drafts with :class:`MTPDraft`.
Exercised by ``pytest tests/test_mtp.py tests/test_mtp_train.py tests/test_mtp_serve.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.kernels._common import staged
from lmforge.model.kv_cache import KVCache
from lmforge.model.layers import Linear, RMSNorm
from lmforge.utils.errors import LmforgeError

__all__ = ["MTPDraft", "MTPModule", "MultiTokenPrediction", "mtp_draft", "mtp_loss", "step_cache"]

Block = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MTPModule(nn.Module):
    """One MTP depth: input norms, the (2D -> D) projection, a block, the output norm."""

    def __init__(self, d_model: int, block: nn.Module, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.enorm = RMSNorm(d_model, norm_eps)
        self.hnorm = RMSNorm(d_model, norm_eps)
        self.proj = Linear(2 * d_model, d_model)
        self.block = block
        self.norm_out = RMSNorm(d_model, norm_eps)

    def forward(
        self, h_prev: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """h^{k-1} (B, T, D) and Emb(t_{i+k}) (B, T, D) at ``positions`` (T,) -> h^k (B, T, D)
        (before ``norm_out``)."""
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))  # (B, T, D)
        return self.block(x, positions)  # (B, T, D)


class MultiTokenPrediction(nn.Module):
    """D sequential MTP modules; ``block_factory(k)`` builds depth k's block (k = 0..D-1)."""

    def __init__(
        self,
        d_model: int,
        depth: int,
        block_factory: Callable[[int], nn.Module],
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if not isinstance(depth, int) or depth < 1:
            raise LmforgeError(f"MTP depth must be an integer >= 1, got {depth!r}")
        self.depth = depth
        self.layers = nn.ModuleList(
            MTPModule(d_model, block_factory(k), norm_eps) for k in range(depth)
        )

    def hidden_states(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """The main model's hidden states (B, T, D) over input ``tokens`` (B, T) -> each depth
        k = 1..D's output-head input ``norm_out(h^k)``, (B, T-k, D): row i predicts t_{i+k+1}
        (the labels ``y[:, k:]`` when y is ``tokens`` shifted by one). Depths with T-k < 1 are
        left out."""
        t = tokens.shape[1]
        out: list[torch.Tensor] = []
        h = hidden
        for k, module in enumerate(self.layers, start=1):
            n = t - k
            if n < 1:
                break
            positions = torch.arange(n, device=hidden.device)  # (T-k,)
            h = module(h[:, :n], embed(tokens[:, k:]), positions)  # (B, T-k, D)
            out.append(module.norm_out(h))  # (B, T-k, D)
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Logits of each depth, (B, T-k, V): ``head`` of :meth:`hidden_states`."""
        return [head(h) for h in self.hidden_states(hidden, tokens, embed)]


def mtp_loss(
    mtp: MultiTokenPrediction,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    weight: float,
    ignore_index: int = -100,
    ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(λ / D · Σ_k CE_k, [CE_1, …, CE_D])`` for inputs ``tokens`` (B, T) with next-token
    ``labels`` (B, T) (the main loss's targets; ``ignore_index`` entries skipped) and the main
    model's ``hidden`` (B, T, D). Depth k's row i is scored against ``labels[:, i + k]``; each
    CE_k is a mean over its scored tokens, in fp32.

    ``ce(h (N, D), targets (N,)) -> mean loss`` replaces ``head`` + cross-entropy (the trainer's
    fused linear + cross-entropy kernel, so no (N, V) logits are materialised)."""
    per_depth = []
    for k, h in enumerate(mtp.hidden_states(hidden, tokens, embed), start=1):
        target = labels[:, k:].flatten()  # (B·(T-k),)
        h = h.flatten(0, 1)  # (B·(T-k), D)
        if ce is not None:
            per_depth.append(ce(h, target))
        else:
            logits = head(h).float()  # (B·(T-k), V)
            per_depth.append(F.cross_entropy(logits, target, ignore_index=ignore_index))
    if not per_depth:
        raise LmforgeError(f"MTP needs sequences longer than 1 token, got {tokens.shape[1]}")
    return weight * torch.stack(per_depth).mean(), per_depth


@torch.no_grad()
def mtp_draft(
    mtp: MultiTokenPrediction,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """k greedy drafts (B, k) after ``tokens`` (B, n + 1): the main model's hidden states
    (B, n, D) cover ``tokens[:, :n]``, and ``tokens[:, n]`` is the token it just sampled."""
    n = hidden.shape[1]
    if tokens.shape[1] != n + 1:
        raise ValueError(f"mtp_draft: tokens must be one longer than hidden ({n}), got"
                         f" {tokens.shape[1]}")  # fmt: skip
    positions = torch.arange(n, device=hidden.device)  # (n,)
    seq, h, drafts = tokens, hidden, []
    for j in range(1, k + 1):
        module = mtp.layers[min(j, mtp.depth) - 1]
        h = module(h, embed(seq[:, j : j + n]), positions)  # (B, n, D)
        nxt = head(module.norm_out(h[:, -1])).argmax(-1)  # (B,)
        drafts.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)  # (B, n+1+j)
    return torch.stack(drafts, dim=1)  # (B, k)


def step_cache(model: nn.Module, slots: int) -> KVCache:
    """One MTP draft step's cache for ``model`` (a TransformerLM): its KV layout (GQA or MLA
    latents), one layer, ``slots`` positions (the last one a scratch slot)."""
    return _StepCache.for_model(model, 1, slots, n_layers=1)


class _StepCache(KVCache):
    """A contiguous cache for one draft step's block, whatever its layer index (the MTP block
    is numbered after the main layers), addressed by device tensors: :meth:`place` sets the
    positions of the next forward's rows, whose keys/values go to those slots (padding rows to
    the last, scratch, slot), and each row attends every slot at or before its position. No
    host value is read, so a fixed-shape forward can be captured in a CUDA graph."""

    def place(self, positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Rows at ``positions`` (T,) long, ``real`` (T,) bool (padding rows: position 0 for
        the mask and RoPE, the scratch slot for their writes); returns the rows' slots (T,)."""
        scratch = self.max_seq_len - 1
        pos = torch.where(real, positions, 0)  # (T,)
        self._slots = torch.where(real, positions, scratch)  # (T,)
        keys = torch.arange(self.max_seq_len, device=positions.device)  # (S,)
        allowed = (keys[None, :] <= pos[:, None]) & (keys[None, :] < scratch)  # (T, S)
        self._mask = allowed[None, None]  # (1, 1, T, S)
        return self._slots

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' keys/values (1, K, T, E) at their slots; every slot (1, K, S, E)."""
        self.k[0].index_copy_(2, self._slots, k.to(self.k.dtype))
        self.v[0].index_copy_(2, self._slots, v.to(self.v.dtype))
        return self.k[0], self.v[0]


class _Replay:
    """What stands in for a captured proposal off CUDA (``MTPDraft.graphs`` on the CPU, for
    tests): ``replay()`` reruns the program on the same static buffers, as
    :class:`lmforge.serve.cuda_graphs.StepReplay` does for the engine's decode graphs."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.replay = run


class MTPDraft:
    """A speculative-decoding proposer from the target's own MTP modules (greedy drafts).

    Like :class:`lmforge.serve.speculative.NgramDraft`, ``propose`` returns up to k token ids
    whose draft distribution is one-hot (so exact rejection sampling accepts draft x with
    probability p(x)); unlike it, it needs the target's hidden states of the sequence, which
    the engine's forwards produce (``lmforge.serve.speculative``, ``--speculative mtp``).

    With ``new_cache`` (makes one draft step's cache: :func:`step_cache`, which
    :func:`lmforge.serve.speculative.mtp_draft_for` passes) and a ``key`` per call naming the
    sequence, each draft step keeps its KV cache and outputs across proposals of that sequence
    (module docstring); without either, every call is :func:`mtp_draft`. ``graphs``: replay
    steady-state proposals from a CUDA graph (None: the engine decides, from its own CUDA-graph
    setting; off CUDA a replay is emulated: the program rerun on the same buffers, for tests).
    ``replays`` counts the proposals served by a replay, ``host_reads`` the device values read
    on the host (one per proposal). ``source``: the buffer whose leading rows ``hidden``
    is on every call (the engine's tap, :class:`lmforge.serve.speculative.Speculative` sets
    it); a captured proposal reads it (rows past n never), so without it there is no graph.
    """

    def __init__(
        self,
        mtp: MultiTokenPrediction,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        new_cache: Callable[[], KVCache] | None = None,
        *,
        graphs: bool | None = None,
    ) -> None:
        self.mtp, self.embed, self.head = mtp, embed, head
        self.new_cache = new_cache
        self.graphs = graphs
        self.source: torch.Tensor | None = None
        self._key: object = None
        self._steps: list[tuple[_StepCache, torch.Tensor]] = []  # per step: cache, (S, D) outputs
        self._final: list[int] = []  # per step: leading positions computed from committed tokens
        self._tok: torch.Tensor | None = None  # (S,) the tokens by position, then the drafts
        self._tok_ok = 0  # leading entries of _tok that hold the sequence's committed tokens
        self._ctl: torch.Tensor | None = None  # (1 + K,) n, then each step's first row position
        self._drafts: torch.Tensor | None = None  # (K,) the program's drafts
        self._captured: dict[int, tuple[torch.Tensor, Any]] = {}  # K -> (hidden buffer, graph)
        self.rows_computed = 0
        "draft-step rows run so far (the cost the cache saves: n per step without it)"
        self.replays = 0
        self.host_reads = 0

    def propose(
        self,
        hidden: torch.Tensor,
        tokens: Sequence[int],
        k: int,
        key: object = None,
        *,
        on_device: bool = False,
    ) -> list[int] | torch.Tensor:
        """k drafts after ``tokens`` (n + 1 ids) given the target's hidden states (n, D) of
        ``tokens[:n]``; ``key`` (any object naming the sequence) turns on the step caches.
        ``on_device``: a cached proposal comes back as the program's (k,) device tensor, read
        nothing on the host (the engine feeds it to the verify forward and reads it with the
        verify's results); valid until the next proposal. Other proposals are lists."""
        if k < 1:
            return []
        if key is None or self.new_cache is None:
            n = hidden.shape[0]
            self.rows_computed += k * n
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=hidden.device)
            return mtp_draft(self.mtp, hidden[None], ids, k, self.embed, self.head)[0].tolist()
        return self._propose_cached(hidden, list(tokens), k, key, on_device)

    @torch.inference_mode()
    def _propose_cached(
        self, hidden: torch.Tensor, seq: list[int], k: int, key: object, on_device: bool
    ) -> list[int] | torch.Tensor:
        n = hidden.shape[0]
        if len(seq) != n + 1:
            raise ValueError(f"MTPDraft: tokens must be one longer than hidden ({n}), got"
                             f" {len(seq)}")  # fmt: skip
        kk = max(k, len(self._steps))  # every step made so far stays current
        self._ensure(kk, hidden)
        if key is not self._key:
            self._key, self._final, self._tok_ok = key, [0] * len(self._final), 0
        slots = self._steps[0][0].max_seq_len
        if n + kk > slots - 1:  # longer than the caches (the last slot is scratch): the reference
            return self.propose(hidden, seq, k)
        assert self._tok is not None and self._ctl is not None and self._drafts is not None
        starts = [min(self._final[j], n) for j in range(kk)]
        rows = max(max(n - s for s in starts), 1)
        self.rows_computed += sum(n - s for s in starts)
        lo = self._tok_ok  # the committed tokens the device has not seen yet (drafts after them)
        dev = self._tok.device  # copies from pinned memory: no wait for the queued work
        self._tok[lo : n + 1].copy_(staged(seq[lo : n + 1], torch.long, dev), non_blocking=True)
        self._ctl.copy_(staged([n, *starts], torch.long, dev), non_blocking=True)
        buffer = self.source
        if self.graphs and buffer is not None and rows <= 2 * kk and _prefix_of(hidden, buffer):
            self._graph(kk, buffer).replay()  # steady state: 2k rows a step, one launch
            self.replays += 1
        else:  # the first proposal of a sequence (n rows), or catching up: eager, exact rows
            self._program(hidden, kk, rows)
        for j in range(kk):  # step j + 1's positions <= n - j - 1 read committed tokens only
            self._final[j] = max(n - j, 0)
        self._tok_ok = n + 1
        if on_device:
            return self._drafts[:k]
        self.host_reads += 1
        return self._drafts[:k].tolist()  # the one read of a proposal

    def _ensure(self, kk: int, hidden: torch.Tensor) -> None:
        """The step caches, output buffers and control tensors for ``kk`` steps."""
        if len(self._steps) >= kk and self._drafts is not None:
            return
        while len(self._steps) < kk:
            cache = self.new_cache()  # type: ignore[misc]
            assert isinstance(cache, _StepCache)
            self._steps.append((cache, hidden.new_zeros(cache.max_seq_len, hidden.shape[1])))
            self._final.append(0)
        dev, slots = hidden.device, self._steps[0][0].max_seq_len
        if self._tok is None:
            self._tok = torch.zeros(slots, dtype=torch.long, device=dev)
        self._ctl = torch.zeros(1 + kk, dtype=torch.long, device=dev)
        self._drafts = torch.zeros(kk, dtype=torch.long, device=dev)
        self._captured.clear()  # they read the old control tensors

    def _program(self, hidden: torch.Tensor, kk: int, rows: int) -> None:
        """One proposal on the device, ``rows`` rows a step (padding past n): each step
        j = 1..kk runs its rows from position ``_ctl[j]`` on over its cache and output buffer,
        then drafts from position n - 1's output into ``_drafts`` and the token buffer (the
        next step's input). Reads nothing on the host; rerunning it with the same control
        values recomputes the same values (the warm-up before a capture relies on it)."""
        assert self._tok is not None and self._ctl is not None and self._drafts is not None
        n = self._ctl[:1]  # (1,)
        last = n - 1  # (1,)
        offsets = torch.arange(rows, device=n.device)  # (R,)
        prev = hidden  # step j - 1's outputs by position (rows < n are valid)
        for j in range(1, kk + 1):
            module = self.mtp.layers[min(j, self.mtp.depth) - 1]
            cache, out = self._steps[j - 1]
            pos = self._ctl[j : j + 1] + offsets  # (R,)
            real = pos < n
            src = torch.where(real, pos, 0)  # (R,) padding rows read row 0
            ids = self._tok.index_select(0, src + j)[None]  # (1, R): t_{i+j}
            h = prev.index_select(0, src)[None]  # (1, R, D)
            x = module.proj(torch.cat([module.enorm(self.embed(ids)), module.hnorm(h)], dim=-1))
            slots = cache.place(pos, real)  # (R,)
            out.index_copy_(0, slots, module.block(x, src[None], kv_cache=cache)[0])  # (R, D)
            h_last = module.norm_out(out.index_select(0, last))  # (1, D)
            nxt = self.head(h_last).argmax(-1)  # (1,)
            self._drafts[j - 1 : j].copy_(nxt)
            self._tok.index_copy_(0, n + j, nxt)  # t_{n+j}
            prev = out

    def _graph(self, kk: int, buffer: torch.Tensor) -> Any:
        """The steady-state proposal of ``kk`` steps (2·kk rows each) over ``buffer``: captured
        once (a CUDA graph; off CUDA, or if the capture fails, the program rerun eagerly)."""
        got = self._captured.get(kk)
        if got is not None and got[0] is buffer:
            return got[1]
        rows = 2 * kk

        def run() -> None:
            self._program(buffer, kk, rows)

        graph: Any = _Replay(run)
        if buffer.is_cuda:
            try:
                stream = torch.cuda.Stream(buffer.device)
                stream.wait_stream(torch.cuda.current_stream(buffer.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (cuBLAS handles, Triton compiles)
                        run()
                torch.cuda.current_stream(buffer.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            except Exception as e:  # any capture failure: eager proposals, said once
                print(f"lmforge serve: CUDA graph capture of the MTP draft failed, drafting"
                      f" eagerly ({str(e).splitlines()[0][:300]})", file=sys.stderr)  # fmt: skip
                self.graphs = False
                graph = _Replay(run)
        self._captured[kk] = (buffer, graph)
        return graph


def _prefix_of(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``view`` is the leading rows of 2-D ``buffer`` (same storage, start, row stride)."""
    return (
        buffer.dim() == 2
        and view.dim() == 2
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[0] <= buffer.shape[0]
        and view.shape[1] == buffer.shape[1]
    )
