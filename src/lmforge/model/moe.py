"""Mixture-of-experts feed-forward: router, three routing modes, balancing, expert compute.

One MoE layer replaces a block's SwiGLU (``model.moe.*``: every ``moe.every``-th layer after
the first ``moe.first_dense_layers``, DeepSeek-V3's first_k_dense_replace). Each
token's hidden state x (D) is scored against N experts by a linear router (fp32 logits from
a GEMM in the compute dtype: :func:`router_logits`): ``s = softmax(x Wr)`` or ``sigmoid(x Wr)``. Routing turns the (M, N) scores of the
M = B·T tokens of a batch into *assignments* (token, expert, gate weight):

- ``token_choice`` (dropless): each token takes its top-k experts of ``s + b`` (b: the
  auxiliary-loss-free selection bias, zero unless ``bias_update_rate > 0`` or imported as
  DeepSeek-V3's ``e_score_correction_bias``); the gate weights are the unbiased scores of those
  experts, divided by their sum when ``norm_top_k``, times ``routed_scale``. With
  ``n_groups > 1`` (DeepSeek-V3's group-limited routing) a token first keeps its ``top_groups``
  best expert groups (a group's score: the sum of its two best ``s + b``) and picks its top-k
  among their experts only. A token's output depends on that token alone: causal.
- ``token_choice_capacity``: the same choices, but an expert takes at most
  C = ⌈capacity_factor · M · k / N⌉ of them; the rest are dropped (gate weight 0, the residual
  carries the token). Priority is GShard/V-MoE's batch-prioritised order: all first choices
  before second choices, higher scores first. Which tokens survive depends on the other tokens of
  the batch, later positions and other sequences included: NOT causal.
- ``expert_choice`` (Zhou et al. 2022): each expert takes the C tokens of the batch with its
  highest scores (``C = ⌈capacity_factor · M · k / N⌉``); a token gets 0..N experts: NOT causal.

Balancing (training forwards only): the Switch/GShard loss ``N · Σ_e f_e · P_e`` (f_e the share
of top-k choices that picked e before dropping, P_e the mean normalised score), the router
z-loss ``mean(logsumexp(x Wr)²)``, both scaled by their coefficients and exposed through
:meth:`MoEFFN.aux_loss`; and DeepSeek-V3's auxiliary-loss-free bias, moved by
:func:`update_expert_bias` *between* steps (±rate toward the mean load), used only to select
experts, never in the gate weights.

Expert compute, on assignments: the reference (:func:`experts_reference`) loops over experts,
gathers each expert's tokens and adds the weighted outputs back; the fast path
(:func:`experts_grouped`) sorts assignments by expert and runs each projection as one grouped
GEMM over the sorted rows (``torch._grouped_mm`` for bf16 on CUDA; elsewhere a loop over the
sorted segments), then sums each token's weighted rows straight from the sorted order. Dropped assignments (weight 0) are computed and
multiplied by 0, which keeps every shape static (no host sync, CUDA-graph friendly); outputs and
gradients are those of skipping them.

Shape legend: B batch, T sequence, D model dim, M = B·T tokens, N experts, k top-k,
A assignments, F expert hidden size. Exercised by ``pytest tests/test_moe_layer.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.kernels._ops import _define
from lmforge.model.config import ModelConfig
from lmforge.model.layers import Linear, SwiGLU, _trunc_normal_


class Routing(NamedTuple):
    """The assignments of one routing decision (A of them), plus what balancing needs."""

    token_idx: torch.Tensor
    "(A,) long: row of the flattened (M, D) input each assignment reads"
    expert_idx: torch.Tensor
    "(A,) long: expert of each assignment"
    weight: torch.Tensor
    "(A,) fp32 gate weight (0 for a dropped assignment)"
    top_k: int
    "k when the assignments are token-major, k per token (token i owns rows i·k..i·k+k-1); else 0"
    load: torch.Tensor
    "(N,) fp32: top-k choices per expert before dropping (expert_choice: tokens taken)"
    kept: torch.Tensor
    "(A,) bool: assignment not dropped"


# ---------------------------------------------------------------------------------------------
# Routing: pure functions of the scores


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(A,) expert ids -> (N,) long counts, without a host sync: ``torch.bincount`` reads the
    input's max on the host on CUDA (``.item()``), which stalls the queue every MoE layer."""
    counts = torch.zeros(n_experts, dtype=torch.long, device=idx.device)
    return counts.scatter_add_(0, idx.long(), torch.ones_like(idx, dtype=torch.long))


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Slots per expert: ⌈factor · tokens · k / N⌉, at most the number of tokens."""
    return max(1, min(n_tokens, math.ceil(factor * n_tokens * top_k / n_experts)))


def capacity_keep(
    idx: torch.Tensor, w: torch.Tensor, capacity: int, n_experts: int
) -> torch.Tensor:
    """(M, k) bool: which top-k choices fit into their expert's ``capacity`` slots.

    Batch-prioritised order: slot j of every token before slot j+1, and within a slot higher
    weights first (ties by token order). Sort-based, so shapes stay static.
    """
    m, k = idx.shape
    flat_e = idx.t().reshape(-1)  # (k·M,) slot-major
    flat_w = w.detach().t().reshape(-1).float()  # (k·M,)
    slot = torch.div(torch.arange(k * m, device=idx.device), m, rounding_mode="floor")  # (k·M,)
    # weights lie in [0, 1] (normalised scores or sigmoids): slot·2 + (1 - w) orders slot first.
    order = torch.argsort(slot * 2.0 + (1.0 - flat_w.clamp(0, 1)), stable=True)  # (k·M,)
    prio = torch.empty_like(order)
    prio[order] = torch.arange(order.numel(), device=idx.device)
    by_expert = torch.argsort(flat_e * order.numel() + prio)  # expert-major, priority within
    counts = expert_counts(flat_e, n_experts)  # (N,)
    starts = torch.cumsum(counts, 0) - counts  # (N,)
    rank = torch.empty_like(order)
    rank[by_expert] = torch.arange(order.numel(), device=idx.device) - starts[flat_e[by_expert]]
    return (rank < capacity).view(k, m).t()  # (M, k)


def route(
    logits: torch.Tensor,
    cfg: ModelConfig,
    bias: torch.Tensor | None = None,
) -> tuple[Routing, torch.Tensor]:
    """(M, N) router logits -> (assignments, (M, N) fp32 scores) for ``cfg.moe.routing``.

    Scores: softmax or per-expert sigmoid, in fp32 (or wider). Token choice takes each token's
    top-k experts of ``scores + bias`` (among its best groups' experts with ``n_groups > 1``:
    :func:`group_limited`); the gate weights are the unbiased scores of those experts
    (renormalised to sum 1 with ``norm_top_k``), times ``routed_scale``.
    """
    mc = cfg.moe
    m, n = logits.shape
    logits = logits.to(_acc_dtype(logits.dtype))
    scores = logits.softmax(-1) if mc.score == "softmax" else logits.sigmoid()  # (M, N)
    dev = logits.device
    if mc.routing == "expert_choice":
        cap = expert_capacity(m, mc.top_k, n, mc.capacity_factor)
        w, tok = scores.t().topk(cap, dim=-1)  # (N, C) each
        w = w * mc.routed_scale if mc.routed_scale != 1.0 else w
        expert = torch.div(torch.arange(n * cap, device=dev), cap, rounding_mode="floor")
        load = torch.full((n,), float(cap), device=dev)
        kept = torch.ones(n * cap, dtype=torch.bool, device=dev)
        return Routing(tok.reshape(-1), expert, w.reshape(-1), 0, load, kept), scores
    select = scores if bias is None else scores + bias  # (M, N): the bias only selects
    if mc.n_groups > 1:
        select = group_limited(select, mc.n_groups, mc.top_groups)  # (M, N)
    idx = select.topk(mc.top_k, dim=-1).indices  # (M, k)
    raw = w = scores.gather(-1, idx)  # (M, k)
    if mc.norm_top_k:
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
    if mc.routed_scale != 1.0:
        w = w * mc.routed_scale
    load = expert_counts(idx.reshape(-1), n).float()  # (N,)
    if mc.routing == "token_choice_capacity":
        cap = expert_capacity(m, mc.top_k, n, mc.capacity_factor)
        keep = capacity_keep(idx, raw, cap, n)  # priority: raw scores
        w = w * keep  # (M, k): dropped choices weigh 0
    else:
        keep = torch.ones_like(idx, dtype=torch.bool)
    token = torch.div(torch.arange(m * mc.top_k, device=dev), mc.top_k, rounding_mode="floor")
    routing = Routing(token, idx.reshape(-1), w.reshape(-1), mc.top_k, load, keep.reshape(-1))
    return routing, scores


def group_limited(select: torch.Tensor, n_groups: int, top_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: (M, N) selection scores with every expert outside
    each token's ``top_groups`` best groups set to -inf. The N experts form ``n_groups``
    contiguous groups of N / n_groups; a group's score is the sum of its two highest selection
    scores (bias included), so one outlier expert cannot carry a group alone."""
    m, n = select.shape
    grouped = select.view(m, n_groups, n // n_groups)  # (M, G, N/G)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (M, G)
    best = group_score.topk(top_groups, dim=-1).indices  # (M, g)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # (M, G)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(m, n)  # (M, N)


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, D) tokens, (N, D) router weight -> (M, N) logits in fp32 (or wider).

    The GEMM's inputs are in the compute dtype (autocast's, or x's own bf16/fp16) and it
    accumulates and writes in fp32: the router's scores, top-k and gate weights stay fp32, but
    the GEMM runs on tensor cores (CUDA: ``torch.mm(..., out_dtype=torch.float32)``). With fp32
    inputs the forward and both backward GEMMs ran as fp32 SIMT kernels on the H200 (cutlass
    simt sgemm, xmma ffma: ~0.32 ms at 32k × 768 × 64, 7% of the layer). Off CUDA the same
    autograd Function widens the rounded operands exactly and runs an fp32 GEMM: the same values
    up to summation order. Exercised by ``pytest tests/test_moe_layer.py -k router_logits``.
    """
    dt = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        if dt not in (torch.bfloat16, torch.float16):  # fp32 / float64: as given
            acc = _acc_dtype(x.dtype)
            return x.to(acc) @ w.to(acc).t()  # (M, N)
        return _RouterMM.apply(x, w, dt)  # (M, N) fp32


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16/fp16 operands with an fp32 result: cuBLAS's fp32-output GEMM on CUDA;
    elsewhere an fp32 GEMM of the same (exactly widened) values."""
    if a.is_cuda and _mm_out_dtype_ok():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _mm_lowp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16/fp16 operands, fp32 accumulation, result rounded to a's dtype."""
    if a.is_cuda:
        return torch.mm(a, b)
    return torch.mm(a.float(), b.float()).to(a.dtype)


def _mm_out_dtype_ok() -> bool:
    # aten::mm.dtype (bf16/fp16 in, fp32 out on CUDA) exists from torch 2.8 on; ``hasattr`` on the
    # op traces under torch.compile (``overloads()`` would break the graph).
    return hasattr(torch.ops.aten.mm, "dtype")


class _RouterMM(torch.autograd.Function):
    """``x @ wᵀ`` with x, w rounded to ``dt`` and an fp32 result (cuBLAS accumulates in fp32);
    backward: the incoming fp32 gradient rounded to ``dt``; dx in ``dt`` as autocast's Linear
    makes it, dw with an fp32 output (the router's weight is fp32 under master weights too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        xc, wc = x.to(dt), w.to(dt)  # (M, D), (N, D)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, w.dtype)
        return _mm_fp32(xc, wc.t())  # (M, N)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        gc = g.to(xc.dtype)  # (M, N)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # dx rounded to dt, as autocast's Linear computes it: the same bits whether x arrives
            # in fp32 (autocast over fp32 weights) or in bf16 (master weights).
            gx = _mm_lowp(gc, wc).to(x_dtype)  # (M, D)
        if ctx.needs_input_grad[1]:
            gw = _mm_fp32(gc.t(), xc).to(w_dtype)  # (N, D)
        return gx, gw, None


def switch_aux_loss(scores: torch.Tensor, load: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard balance loss ``N · Σ_e f_e · P_e``: f_e = load share (no gradient),
    P_e = mean score share (sigmoid scores normalised per token). 1 when perfectly balanced."""
    m, n = scores.shape
    p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)  # (M, N)
    f = load / max(m * top_k, 1)  # (N,)
    return n * (f.detach() * p.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def routing_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the normalised router scores."""
    p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)  # (M, N)
    return -(p * p.clamp_min(1e-20).log()).sum(-1).mean()


# ---------------------------------------------------------------------------------------------
# Expert compute: the reference loop and the sorted, grouped fast path


def experts_reference(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, r: Routing
) -> torch.Tensor:
    """Readable expert compute: for each expert, gather its tokens, run its SwiGLU, add the
    gate-weighted result to those tokens. x (M, D); w1, w3 (N, F, D); w2 (N, D, F) -> (M, D)
    fp32."""
    out = torch.zeros(x.shape, dtype=_acc_dtype(x.dtype), device=x.device)  # (M, D)
    for e in range(w1.shape[0]):
        sel = (r.expert_idx == e).nonzero().squeeze(1)  # (n_e,)
        if sel.numel() == 0:
            continue
        tok = r.token_idx[sel]  # (n_e,)
        xe = x[tok]  # (n_e, D)
        y = (F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t()  # (n_e, D): its SwiGLU
        out.index_add_(0, tok, y.to(out.dtype) * r.weight[sel, None])
    return out


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """Whether :func:`grouped_mm` runs ``torch._grouped_mm`` for x (A, K) @ w (N, K, O): bf16 on
    CUDA of compute capability ≥ 8.0, at least one row, K and O multiples of 8 (16-byte rows and
    columns: the op checks every operand's strides, those of the backward's x.t() and gradients
    included, against 16 bytes). Anything else takes the per-segment loop."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    dims_ok = x.shape[-1] % 8 == 0 and (w is None or w.shape[-1] % 8 == 0)
    return dims_ok and x.shape[0] > 0 and _sm80_or_newer(x.device.index or 0)


@torch.compiler.assume_constant_result
def _sm80_or_newer(index: int) -> bool:
    # A constant while torch.compile traces: Dynamo constant-folds get_device_properties but
    # not get_device_capability (torch 2.13's list), and the CUDA compile test runs this path.
    return torch.cuda.get_device_capability(index) >= (8, 0)


def grouped_mm_layout_ok(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` accepts t's memory layout: a 16-byte aligned data pointer and
    the last two dimensions row- or column-major with the other stride a multiple of 16 bytes
    (the op's own stride check, mirrored from its meta function)."""
    if t.dim() < 2:
        return False
    # ``data_ptr`` (and ``storage_offset``) cannot be read while torch.compile traces: it broke
    # the graph at every grouped GEMM and sent the whole model's forward back to eager. Traced,
    # only the strides are checked; the operands here are fresh, whole tensors there (gather,
    # cat, gate outputs), which the compiler allocates aligned.
    if not torch.compiler.is_compiling() and t.data_ptr() % 16:
        return False
    align = 16 // t.element_size()
    (s0, s1), (n0, n1) = t.stride()[-2:], t.shape[-2:]
    if s0 == 1 and s1 >= max(1, n0):
        return s1 % align == 0
    if s1 == 1 and s0 >= max(1, n1):
        return s0 % align == 0
    return False


def _gmm_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when :func:`grouped_mm_layout_ok`, else a fresh contiguous copy (a stride-0
    gradient of ``sum()``, a sliced view off a 16-byte boundary)."""
    if grouped_mm_layout_ok(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with its backward written out (two more grouped GEMMs); every
    operand, the incoming gradient included, brought to a layout the op accepts first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, w = _gmm_operand(x), _gmm_operand(w)
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)  # (A, O)

    @staticmethod
    def backward(ctx, gy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        gy = _gmm_operand(gy)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch._grouped_mm(gy, _gmm_operand(w.transpose(-2, -1)), offs=offs)  # (A, K)
        if ctx.needs_input_grad[1]:
            if w.stride(-2) == 1:  # w is a transposed (N, O, K) weight: its grad in that layout
                gw = torch._grouped_mm(_gmm_operand(gy.t()), x, offs=offs).transpose(-2, -1)
            else:  # as torch's own derivative of _grouped_mm chooses, groups along A either way
                gw = torch._grouped_mm(_gmm_operand(x.t()), gy, offs=offs)  # (N, K, O)
        return gx, gw, None


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """Rows of x sorted by group (``counts`` (N,) rows each, ``offs`` their int32 cumulative
    ends) times that group's matrix: x (A, K), w (N, K, O) -> (A, O).

    ``torch._grouped_mm`` where :func:`grouped_mm_available`; otherwise one matmul per segment
    (the readable fallback, which reads ``counts`` on the host)."""
    if grouped_mm_available(x, w):
        return _GroupedMM.apply(x, w.to(x.dtype), offs)
    parts = torch.split(x, counts.tolist())
    return torch.cat([p @ w[e].to(p.dtype) for e, p in enumerate(parts)])  # (A, O)


def _triton_moves(t: torch.Tensor) -> bool:
    """Whether the Triton gather/combine kernels take t: CUDA (or the CPU interpreter under
    ``TRITON_INTERPRET=1``), fp16/bf16/fp32, Triton installed."""
    from lmforge.kernels._common import TRITON_DTYPES, interpreting, triton_available

    return (t.is_cuda or interpreting()) and t.dtype in TRITON_DTYPES and triton_available()


def gather_sum_reference(
    src: torch.Tensor, idx: torch.Tensor, k: int, w: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[t] = Σ_j w[t·k + j] · src[idx[t·k + j]]`` (w None: weights 1): src (A, D), idx and
    w (M·k,) -> (M, D) ``out_dtype`` (the torch form of the Triton kernel)."""
    acc = torch.promote_types(out_dtype, torch.float32)
    rows = src.index_select(0, idx).to(acc).view(-1, k, src.shape[-1])  # (M, k, D)
    if w is not None:
        rows = rows * w.to(acc).view(-1, k, 1)
    return rows.sum(1).to(out_dtype)  # (M, D)


def combine_backward_reference(
    g: torch.Tensor,
    ys: torch.Tensor,
    order: torch.Tensor,
    inv: torch.Tensor,
    w: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``gather_sum(ys, inv, k, w)``: g (M, D), ys (A, D) sorted rows, w (A,)
    token-major -> (dys (A, D) in ys's dtype, dw (A,) token-major, fp32 or wider)."""
    acc = torch.promote_types(g.dtype, torch.float32)
    gs = g.to(acc).index_select(0, torch.div(order, k, rounding_mode="floor"))  # (A, D) sorted
    dys = (gs * w.to(acc)[order, None]).to(ys.dtype)  # (A, D)
    dw_sorted = (gs * ys.to(acc)).sum(-1)  # (A,)
    return dys, dw_sorted[inv]  # dw[a] = dw_sorted[inv[a]]


# The two Triton kernels as torch custom ops (``torch.ops.lmforge.moe_*``): torch.compile sees
# each as one graph node with a fake (shape-only) implementation, where a raw Triton launch inside
# the autograd Functions below broke the graph in every MoE layer on CUDA (9 breaks for 2 layers
# on the H200) and, under TRITON_INTERPRET=1, made Dynamo trace into the interpreter itself. The
# autograd Functions stay: they call these ops forward and backward, which Dynamo traces.
def _moe_gather_sum_impl(
    src: Tensor, idx: Tensor, w: Tensor, k: int, weighted: bool, out_dtype: torch.dtype
) -> Tensor:
    # ``weighted`` rather than an optional w: plain Tensor arguments are the schema every torch
    # version since 2.4 infers the same way.
    from lmforge.model import _moe_triton

    wf = w.float().contiguous() if weighted else None
    return _moe_triton.gather_sum(src.contiguous(), idx.contiguous(), k, wf, out_dtype)


def _moe_gather_sum_fake(
    src: Tensor, idx: Tensor, w: Tensor, k: int, weighted: bool, out_dtype: torch.dtype
) -> Tensor:
    return src.new_empty((idx.shape[0] // k, src.shape[1]), dtype=out_dtype)


def _moe_combine_bwd_impl(
    g: Tensor, ys: Tensor, order: Tensor, w: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    from lmforge.model import _moe_triton

    return _moe_triton.combine_backward(
        g.contiguous(), ys.contiguous(), order.contiguous(), w.float().contiguous(), k
    )


def _moe_combine_bwd_fake(
    g: Tensor, ys: Tensor, order: Tensor, w: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(ys, memory_format=torch.contiguous_format), ys.new_empty(
        ys.shape[0], dtype=torch.float32
    )


_moe_gather_sum_op = _define("moe_gather_sum", _moe_gather_sum_impl, _moe_gather_sum_fake)
_moe_combine_bwd_op = _define("moe_combine_bwd", _moe_combine_bwd_impl, _moe_combine_bwd_fake)


def _gather_sum(
    src: torch.Tensor, idx: torch.Tensor, k: int, w: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    if _triton_moves(src):
        return _moe_gather_sum_op(src, idx, idx if w is None else w, k, w is not None, out_dtype)
    return gather_sum_reference(src, idx, k, w, out_dtype)


class _Gather(torch.autograd.Function):
    """``x[order // k]`` in ``dtype``: the sorted token-major assignments' input rows (row i
    reads token ``order[i] // k``). Backward without a scatter-add: token t's gradient is the sum
    of its k sorted gradient rows ``inv[t·k + j]`` (one gather-sum, written in x's dtype, so the
    cast to ``dtype`` costs no extra pass backward)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, k: int, dtype: torch.dtype
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inv)
        ctx.k, ctx.x_dtype = k, x.dtype
        return x.to(dtype).index_select(0, torch.div(order, k, rounding_mode="floor"))  # (A, D)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        (inv,) = ctx.saved_tensors
        return _gather_sum(g, inv, ctx.k, None, ctx.x_dtype), None, None, None, None  # (M, D)


class _Combine(torch.autograd.Function):
    """Sorted expert outputs ys (A, D) -> (M, D): ``out[t] = Σ_j w[t, j] · ys[inv[t·k + j]]``
    accumulated in fp32 (or wider), stored in ``out_dtype``, with no un-permuted copy of ys.
    Backward: ``dys[s] = w[a] · g[t]`` and ``dw[a] = <g[t], ys[s]>`` for a = order[s],
    t = a // k (one pass over the sorted rows)."""

    @staticmethod
    def forward(
        ctx,
        ys: torch.Tensor,
        w: torch.Tensor,
        order: torch.Tensor,
        inv: torch.Tensor,
        k: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ys, w, order, inv)
        ctx.k = k
        return _gather_sum(ys, inv, k, w.reshape(-1), out_dtype)  # (M, D)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:  # type: ignore[override]
        ys, w, order, inv = ctx.saved_tensors
        k = ctx.k
        wf = w.reshape(-1)
        if _triton_moves(ys) and g.dtype in (torch.float32, ys.dtype):
            dys, dw = _moe_combine_bwd_op(g, ys, order, wf, k)
        else:
            dys, dw = combine_backward_reference(g, ys, order, inv, wf, k)
        return dys, dw.to(w.dtype).view(w.shape), None, None, None, None


def _swiglu_act(h: torch.Tensor, f: int) -> torch.Tensor:
    """silu(h[:, :F]) · h[:, F:]: lmforge's packed Triton gate where it runs (its backward writes
    the (A, 2F) gradient in one pass, no split/cat copies), else the torch math."""
    if _triton_moves(h):
        from lmforge.kernels import swiglu_packed

        return swiglu_packed(h)
    gate, up = h.split(f, dim=-1)  # (A, F) each
    return F.silu(gate) * up


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype when wider (float64 tests stay float64)."""
    return torch.promote_types(dtype, torch.float32)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type) and x.dtype == torch.float32:
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def expert_rows(
    xs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Every expert's SwiGLU on its rows: xs (A, D) sorted by expert, ``counts`` (N,) rows per
    expert -> (A, D); w1|w3 as one grouped GEMM, then w2. Weights are cast to xs's dtype (before
    the concatenation, so the copy moves bf16, not fp32)."""
    f = w1.shape[1]
    dt = xs.dtype
    offs = torch.cumsum(counts, 0).to(torch.int32)  # (N,)
    w13 = torch.cat([w1.to(dt), w3.to(dt)], dim=1)  # (N, 2F, D)
    h = grouped_mm(xs, w13.transpose(1, 2), counts, offs)  # (A, 2F)
    return grouped_mm(_swiglu_act(h, f), w2.to(dt).transpose(1, 2), counts, offs)  # (A, D)


def experts_grouped(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    r: Routing,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fast expert compute: sort assignments by expert, three grouped GEMMs (w1|w3 as one),
    combine straight from the sorted rows. Same arguments and result as
    :func:`experts_reference`; ``out_dtype`` (token-major routings) stores the fp32 sum in that
    dtype directly (the same values as casting the result, one pass fewer each way)."""
    n = w1.shape[0]
    dtype = _compute_dtype(x)
    # int32 keys: half the radix-sort passes of int64 on CUDA; stable keeps token order per expert.
    order = torch.argsort(r.expert_idx.to(torch.int32), stable=True)  # (A,)
    counts = expert_counts(r.expert_idx, n)  # (N,)
    if r.top_k:  # token-major: token of row order[i] is order[i] // k
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)  # (A,)
        xs = _Gather.apply(x, order, inv, r.top_k, dtype)  # (A, D) sorted by expert
        ys = expert_rows(xs, w1, w2, w3, counts)  # (A, D)
        m, k = x.shape[0], r.top_k
        out = out_dtype or _acc_dtype(ys.dtype)
        return _Combine.apply(ys, r.weight.view(m, k), order, inv, k, out)  # (M, D)
    # index_select: its backward is an index_add_ (indexing's would sort the indices first); the
    # sorted rows are combined as the assignments of the same routing in sorted order.
    tok = r.token_idx.index_select(0, order)  # (A,) token of each sorted row
    ys = expert_rows(x.to(dtype).index_select(0, tok), w1, w2, w3, counts)  # (A, D) by expert
    return combine(ys, r._replace(token_idx=tok, weight=r.weight[order]), x.shape[0])  # (M, D)


def combine(y: torch.Tensor, r: Routing, m: int) -> torch.Tensor:
    """Assignment outputs y (A, D), in assignment order, weighted and summed per token -> (M, D)."""
    d = y.shape[-1]
    if r.top_k:  # token-major, k per token: a (1, k) @ (k, D) weighted sum per token
        wk = r.weight.view(m, 1, r.top_k).to(y.dtype)  # (M, 1, k)
        return torch.bmm(wk, y.view(m, r.top_k, d)).view(m, d).to(_acc_dtype(y.dtype))
    out = torch.zeros((m, d), dtype=_acc_dtype(y.dtype), device=y.device)
    return out.index_add_(0, r.token_idx, y.to(out.dtype) * r.weight[:, None])  # (M, D)


ExpertCompute = Callable[["MoEFFN", torch.Tensor, Routing], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# The layer


class MoEFFN(nn.Module):
    """Router + N routed SwiGLU experts (+ optional shared experts), in place of a block's FFN.

    Parameters: ``router.weight`` (N, D); ``w1``, ``w3`` (N, F, D) and ``w2`` (N, D, F), one
    stacked tensor per projection (the layout of Linear weights, one per expert); ``shared`` a
    SwiGLU of width ``n_shared_experts · F`` (equal to that many experts summed), its output
    scaled per token by σ(x W_g) with ``shared_gate`` ((1, D), ``moe.shared_gate``). Buffers:
    ``expert_bias`` (N,) fp32, the auxiliary-loss-free selection bias (in checkpoints);
    ``load_acc`` (N,), the choices counted since the last :func:`update_expert_bias` (not saved).

    ``expert_compute`` (None = :attr:`backend`'s function) may be replaced from outside, as
    expert parallelism does (:mod:`lmforge.parallel.ep`); it receives the layer, the flattened
    input (M, D) and the :class:`Routing`. ``record_routing = True`` keeps the last routing in
    ``last_routing`` (the causality probe reads it).
    """

    expert_bias: torch.Tensor
    load_acc: torch.Tensor

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        mc = config.moe
        self.config = config
        self.layer_idx = layer_idx
        n, d, f = mc.n_experts, config.d_model, config.expert_dim
        self.n_experts, self.d_model, self.d_expert = n, d, f
        self.router = Linear(d, n)
        self.w1 = nn.Parameter(torch.empty(n, f, d))
        self.w2 = nn.Parameter(torch.empty(n, d, f))
        self.w3 = nn.Parameter(torch.empty(n, f, d))
        self.shared = SwiGLU(d, mc.n_shared_experts * f) if mc.n_shared_experts else None
        self.shared_gate = Linear(d, 1) if mc.shared_gate else None  # Qwen3-Next's
        self.register_buffer("expert_bias", torch.zeros(n))
        self.register_buffer("load_acc", torch.zeros(n), persistent=False)
        self.backend = "reference" if mc.backend == "reference" else "grouped"
        self.expert_compute: ExpertCompute | None = None
        self.record_routing = False
        self.last_routing: Routing | None = None
        self._aux: torch.Tensor | None = None
        # (load, kept, detached scores) of the last training forward: the routing statistics are
        # computed from them only when read (log steps), not in every forward (~15 kernels).
        self._stats_src: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Experts like Linear weights (σ = sqrt(2/(D+F)), ±3σ); bias and load to zero."""
        std = math.sqrt(2.0 / (self.d_model + self.d_expert))
        for w in (self.w1, self.w2, self.w3):
            _trunc_normal_(w, std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.load_acc.zero_()

    def aux_loss(self) -> torch.Tensor | None:
        """The balancing + z-loss term of the last training forward (None in eval / when off)."""
        return self._aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # (M, D)
        logits = router_logits(xf, self.router.weight)  # (M, N) fp32
        r, scores = route(logits, self.config, self.expert_bias.to(logits.dtype))
        compute = self.expert_compute
        if compute is None:
            compute = _compute_reference if self.backend == "reference" else _compute_grouped
        out = compute(self, xf, r)  # (M, D) fp32 (the grouped path: already the output dtype)
        if self.shared is not None:
            shared = self.shared(xf)  # (M, D)
            if self.shared_gate is not None:  # σ(x W_g) per token (M, 1)
                shared = torch.sigmoid(self.shared_gate(xf)) * shared
            out = out + shared.to(out.dtype)
        if self.record_routing:
            self.last_routing = r
        if self.training:
            self._balance(logits, scores, r)
        else:
            self._aux = None
        # The dense FFN returns autocast's dtype under autocast; the residual add promotes anyway.
        return out.to(_compute_dtype(x)).view(shape)  # (B, T, D)

    def _balance(self, logits: torch.Tensor, scores: torch.Tensor, r: Routing) -> None:
        mc = self.config.moe
        aux = None
        if mc.aux_loss_coef > 0 and mc.routing != "expert_choice":
            aux = mc.aux_loss_coef * switch_aux_loss(scores, r.load, mc.top_k)
        if mc.z_loss_coef > 0:
            z = mc.z_loss_coef * router_z_loss(logits)
            aux = z if aux is None else aux + z
        self._aux = aux
        with torch.no_grad():
            if mc.bias_update_rate > 0:
                self.load_acc.add_(r.load)
        self._stats_src = (r.load, r.kept, scores.detach())

    @property
    def _stats(self) -> torch.Tensor | None:
        """(3,) fp32 of the last training forward: max/mean expert load, dropped share, router
        entropy (device values, computed on read; None before any training forward)."""
        if self._stats_src is None:
            return None
        load, kept, scores = self._stats_src
        with torch.no_grad():
            dropped = 1.0 - kept.float().sum() / max(kept.numel(), 1)
            load_ratio = load.max() / load.mean().clamp_min(1e-20)
            return torch.stack([load_ratio, dropped, routing_entropy(scores)])


def _compute_reference(layer: MoEFFN, x: torch.Tensor, r: Routing) -> torch.Tensor:
    dtype = _compute_dtype(x)
    w = [p.to(dtype) for p in (layer.w1, layer.w2, layer.w3)]
    return experts_reference(x.to(dtype), *w, r)


def _compute_grouped(layer: MoEFFN, x: torch.Tensor, r: Routing) -> torch.Tensor:
    # Without shared experts the layer's output dtype is final: the combine writes it directly.
    out_dtype = _compute_dtype(x) if layer.shared is None else None
    return experts_grouped(x, layer.w1, layer.w2, layer.w3, r, out_dtype)


# ---------------------------------------------------------------------------------------------
# Model-level helpers (the trainer's hooks)


def moe_layers(model: nn.Module) -> Iterator[MoEFFN]:
    """Every MoE layer of ``model``, in module order."""
    for m in model.modules():
        if isinstance(m, MoEFFN):
            yield m


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' auxiliary losses from the last training forward (None if none)."""
    total = None
    for layer in moe_layers(model):
        a = layer.aux_loss()
        if a is not None:
            total = a if total is None else total + a
    return total


@torch.no_grad()
def update_expert_bias(
    model: nn.Module, group: object | None = None, distributed: bool | None = None
) -> None:
    """DeepSeek-V3's auxiliary-loss-free step, between optimizer steps: every expert's selection
    bias moves by ``+rate`` when its load (choices counted since the last call) is below the
    mean, ``-rate`` when above. Loads are summed over the process ``group`` when distributed
    (``distributed=None``: whenever a process group is joined), so data-parallel replicas keep
    equal biases; all layers' loads travel in one all-reduce. Device ops only (no host read)."""
    import torch.distributed as dist

    layers = [m for m in moe_layers(model) if m.config.moe.bias_update_rate > 0]
    if not layers:
        return
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size(group) > 1:  # type: ignore[arg-type]
        loads = torch.stack([m.load_acc for m in layers])  # (L, N)
        dist.all_reduce(loads, group=group)  # type: ignore[arg-type]
        for m, load in zip(layers, loads):
            m.load_acc.copy_(load)
    for layer in layers:
        load = layer.load_acc
        rate = layer.config.moe.bias_update_rate
        layer.expert_bias.add_(rate * torch.sign(load.mean() - load))
        load.zero_()


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Per-layer routing statistics of the last training forward, for metrics.jsonl:
    ``moe/L{i}/load_max_mean`` (max over mean expert load), ``moe/L{i}/dropped`` (share of
    choices dropped), ``moe/L{i}/entropy`` (router entropy, nats). Reads them to the host."""
    layers = [m for m in moe_layers(model) if m._stats_src is not None]
    if not layers:
        return {}
    stats = torch.stack([m._stats for m in layers]).tolist()  # type: ignore[misc]  # one host read
    out: dict[str, float] = {}
    for m, (ratio, dropped, ent) in zip(layers, stats):
        out[f"moe/L{m.layer_idx}/load_max_mean"] = ratio
        out[f"moe/L{m.layer_idx}/dropped"] = dropped
        out[f"moe/L{m.layer_idx}/entropy"] = ent
    return out


def check_causal_routing(cfg: ModelConfig) -> None:
    """Raise :class:`LmforgeError` for a non-causal routing unless ``moe.allow_noncausal``."""
    from lmforge.utils.errors import LmforgeError

    mc = cfg.moe
    if mc.enabled and not mc.causal and not mc.allow_noncausal:
        raise LmforgeError(
            f"model.moe.routing = '{mc.routing}' is not causal: a token's output depends on later "
            "tokens and other sequences of the batch, which inference cannot see (check with "
            "`lmforge probe causality`); use routing='token_choice' or set "
            "model.moe.allow_noncausal=true to train anyway"
        )
