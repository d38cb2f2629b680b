"""The parallelism planner: a cost model of memory, compute and communication per strategy mix.

All pure functions of a :class:`ModelSpec`, a :class:`Hardware` and a :class:`Mix`, built from
the formulas the strategies embody:

* memory per GPU (bytes): the one memory model, :func:`lmforge.model.accounting.memory_estimate`
  with master weights (bf16 weights 2 + bf16 gradients 2 + fp32 master, m, v 12 = 16 bytes per
  parameter, the ZeRO paper's accounting) and the mix as an :class:`~lmforge.model.accounting.
  Sharding`: ZeRO-1 divides the 12 by the data-parallel degree, ZeRO-2 also the gradients,
  ZeRO-3 also the weights, tp·pp divide everything; activations are lmforge's saved tensors
  for the model's shape (fused attention, so no T×T term; tp splits the per-head and FFN
  tensors, no sequence parallelism; the last pipeline stage's share, with the LM head's input
  and the loss's logits), or each block's input plus one live block with full recomputation.
  Each named model carries a ``ModelConfig`` of that shape; a model given by size only gets a
  Llama-like shape of that width and depth (:func:`config_for`);
* compute: 6·N_active·tokens / (GPUs · peak · MFU) (8·N_active with recomputation);
* communication per step: DP all-reduce moves 2× the (per-replica) parameter bytes, ZeRO-3 3×
  (all-gather forward, all-gather backward, reduce-scatter); over more GPUs than one domain the
  collectives are hierarchical: NVLink inside the domain, and only 1/k of the bytes per GPU over
  the inter-domain links (k = domain size). DP/FSDP traffic overlaps compute, so the step takes
  the larger of the two. TP all-reduces 8·b·s·h·(t−1)/t activation elements per layer (two
  all-reduces forward, two backward) on the critical path; PP sends b·s·h per micro-batch per
  boundary each way;
* pipeline bubble: the step stretches by (p − 1)/m for m micro-batches;
* batch-size floor: at least one sequence per data-parallel rank (dp ≤ global batch), and the
  same whole number on each (dp divides the global batch; else "batch split").

Why FSDP stops scaling: with the global batch fixed, compute per GPU falls as 1/N while the
ZeRO-3 bytes per GPU do not fall at all (each GPU still gathers every parameter), so past the
*crossover* N the step is communication-bound. A larger batch moves the crossover right
(more compute per parameter byte), sparsity (MoE: compute ∝ active, bytes ∝ total) moves it
left, and bigger fast domains (TPU-like pods) move it right (fewer bytes on the slow links).

Calibration: :func:`calibrate` fits the achievable MFU from one measured single-GPU step (and,
given a measured DDP step on one domain, the communication overlap and effective bandwidth) and
returns a :class:`Hardware`; :data:`HARDWARE` holds named presets fitted to measured H200 steps
(``h200-eager``, ``h200-compiled``) beside the issue's assumed ``h200`` defaults.
``benchmarks/planner.py --calibration`` compares the calibrated predictions with the measurements.

Simplifications: a per-hop latency but no message-size dependence of bandwidth, no expert
parallelism, DP/FSDP communication overlapped with compute (perfectly unless
:attr:`Hardware.comm_overlap` says otherwise), even layer split, inputs in decimal units.

Exercise: ``lmforge plan --model 70b --gpus 1024`` and ``pytest tests/test_planner.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from lmforge.model.config import ModelConfig
from lmforge.model.moe_config import MoEConfig


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model as the cost model sees it."""

    name: str
    "label"
    total_params: float
    "all parameters (memory, communication)"
    n_layers: int
    "Transformer blocks"
    d_model: int
    "hidden size h"
    active_params: float = 0.0
    "parameters used per token (MoE); 0 = dense (= total)"
    flops_per_token: float = 0.0
    "model FLOPs per trained token, forward + backward; 0 = 6·active"
    config: ModelConfig | None = None
    "the model's shape, for the memory model; None = :func:`config_for` of the size"

    @property
    def active(self) -> float:
        """Parameters that do work per token."""
        return self.active_params or self.total_params

    @property
    def train_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token without recomputation (6·N_active by default)."""
        return self.flops_per_token or 6.0 * self.active


_SHAPES: dict[str, dict] = {  # ModelConfig fields of the named models
    # GPT-2 small's size with lmforge's blocks (SwiGLU of the GELU MLP's width, tied head).
    "gpt2-small": dict(vocab_size=50257, n_heads=12, d_ff=2048, tie_embeddings=True),
    "7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008),
    "70b": dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672),
    "405b": dict(
        vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, d_ff=53248
    ),
    "moe-47b-a13b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        d_ff=14336,
        moe=dict(n_experts=8, top_k=2),
    ),
}


def _models() -> dict[str, ModelSpec]:
    # Exact parameter counts (accounting) and shapes; compute stays 6·N_active for these.
    from lmforge.model import accounting

    out = {}
    for name, shape in _SHAPES.items():
        moe = MoEConfig(**shape["moe"]) if "moe" in shape else MoEConfig()
        cfg = ModelConfig(**{**shape, "moe": moe})
        total, active = accounting.parameter_count(cfg), accounting.active_parameter_count(cfg)
        out[name] = ModelSpec(name, float(total), cfg.n_layers, cfg.d_model, active, config=cfg)
    return out


MODELS: dict[str, ModelSpec] = _models()
"""Named models: Llama-2 7B/70B, Llama-3.1 405B and Mixtral 8×7B shapes (exact counts: 6.74B,
68.98B, 405.85B, 46.70B total / 12.88B active) and a GPT-2-small-sized lmforge model (123.6M)."""


def config_for(total_params: float, n_layers: int, d_model: int) -> ModelConfig:
    """A Llama-like shape of this size, for the memory model: heads of 128, MHA, vocab 32,000,
    an untied head, and the SwiGLU width that makes the blocks hold the remaining parameters
    (8/3·d when the embeddings alone exceed ``total_params``)."""
    heads = max(1, d_model // 128)
    vocab = 32000
    per_layer = (total_params - 2 * vocab * d_model) / n_layers - 4 * d_model * d_model
    d_ff = round(per_layer / (3 * d_model)) if per_layer > 3 * d_model else None
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=heads,
        head_dim=max(1, d_model // heads),
        d_ff=d_ff,
    )


# The model lmforge's parallel benchmark trains (benchmarks/parallel.py, benchmarks/train.py):
# GPT-2-small shape with vocab 50304, SwiGLU FFN and an untied LM head. Both numbers come from
# lmforge.model.accounting (parameter_count, and flops_per_token at T = 1024: 6·N_matmul plus the
# attention-score term, the convention lmforge's MFU uses); tests/test_planner.py checks them.
GPT2_SMALL_BENCH = ModelSpec(
    "gpt2-small-bench", 162_220_800, 12, 768, flops_per_token=854_654_976.0, config=ModelConfig()
)


def spec_from_config(name: str, cfg: object, seq_len: int) -> ModelSpec:
    """A :class:`ModelSpec` for a ``ModelConfig`` (e.g. a ``configs/`` preset), with its exact
    parameter count and FLOPs per token at ``seq_len`` from :mod:`lmforge.model.accounting`."""
    from lmforge.model import accounting

    return ModelSpec(
        name,
        float(accounting.parameter_count(cfg)),  # type: ignore[arg-type]
        cfg.n_layers,  # type: ignore[attr-defined]
        cfg.d_model,  # type: ignore[attr-defined]
        flops_per_token=accounting.flops_per_token(cfg, seq_len),  # type: ignore[arg-type]
        config=cfg,  # type: ignore[arg-type]
    )


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator type and its interconnect (defaults: NVIDIA H200 in 8-GPU NVLink hosts).

    The defaults are the issue's assumptions for a compiled model (45% MFU, nominal NVLink and
    InfiniBand bandwidth), not a measurement; :data:`HARDWARE` holds presets fitted to measured
    steps, and :func:`calibrate` fits new ones.
    """

    name: str = "H200"
    "label"
    peak_flops: float = 989e12
    "peak dense bf16 FLOP/s per GPU"
    mfu: float = 0.45
    "achievable fraction of peak on the model's matmuls"
    memory_bytes: float = 141e9
    "memory per GPU"
    nvlink_bw: float = 450e9
    "intra-domain bandwidth per GPU per direction (B/s)"
    ib_bw: float = 50e9
    "inter-domain bandwidth per GPU per direction (B/s)"
    domain_size: int = 8
    "GPUs in one fast (NVLink) domain"
    usable_memory: float = 0.9
    "fraction of memory the model may use (allocator, workspace)"
    latency: float = 10e-6
    "latency of one collective hop (s): a ring inside the domain, a tree across domains"
    comm_overlap: float = 1.0
    "fraction of DP/FSDP communication hidden under compute (1: step = max(compute, comm))"
    source: str = "issue 5 assumptions (compiled model at 45% MFU, nominal link bandwidths)"
    "where the numbers come from"


def _overlapped_step(compute: float, comm: float, overlap: float) -> float:
    """Step time when ``overlap`` of the communication hides under compute.

    ``max(compute + (1 − overlap)·comm, comm)``: perfect overlap gives ``max(compute, comm)``,
    none gives ``compute + comm``.
    """
    return max(compute + (1.0 - overlap) * comm, comm)


@dataclasses.dataclass(frozen=True)
class Mix:
    """One strategy mix."""

    dp: int
    "data-parallel degree"
    tp: int = 1
    "tensor-parallel degree"
    pp: int = 1
    "pipeline stages"
    zero: int = 0
    "ZeRO stage over dp: 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ weights, FSDP)"
    recompute: bool = False
    "full activation recomputation"

    @property
    def gpus(self) -> int:
        """GPUs used."""
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        """Short human label, e.g. ``dp64·tp8 zero3 +rc``."""
        parts = [f"dp{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        name = "·".join(parts) + ("" if self.zero == 0 else f" zero{self.zero}")
        return name + (" +rc" if self.recompute else "")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost model's verdict on one mix."""

    mix: Mix
    "the strategy mix"
    memory: dict[str, float]
    "bytes per GPU: weights, grads, optimizer, activations"
    compute_s: float
    "compute time per step (incl. recomputation)"
    comm_s: dict[str, float]
    "communication time per step: dp (overlapped), tp and pp (exposed)"
    bubble: float
    "pipeline bubble as a fraction of the busy time, (p − 1)/m"
    step_s: float
    "predicted step time"
    mfu: float
    "model FLOPs utilisation: 6·N_active·tokens / (step · GPUs · peak)"
    feasible: bool
    "fits in memory and respects the batch floor"
    binding: str
    "what limits this mix: memory, batch floor, batch split, compute, dp-comm, tp-comm, bubble"

    @property
    def memory_total(self) -> float:
        """All bytes per GPU."""
        return sum(self.memory.values())


def collective_time(
    nbytes: float, n: int, hw: Hardware, kind: str = "all_reduce", count: int = 1
) -> float:
    """Seconds for ``count`` collectives over ``n`` GPUs moving ``nbytes`` in total (full size).

    ``kind`` is ``all_gather``/``reduce_scatter`` (each GPU sends (n−1)/n of the bytes) or
    ``all_reduce`` (twice that). Beyond one domain it is hierarchical: the intra-domain phase at
    NVLink speed, and 1/k of the bytes per GPU across domains at the inter-domain speed. Each
    collective also pays ``hw.latency`` per hop: k − 1 ring hops inside the domain plus
    ⌈log2 D⌉ tree hops across D domains.
    """
    if n <= 1:
        return 0.0
    k = min(hw.domain_size, n)
    d = n / k
    one = nbytes * (k - 1) / k / hw.nvlink_bw
    hops = k - 1
    if d > 1:
        one += (nbytes / k) * (d - 1) / d / hw.ib_bw
        hops += math.ceil(math.log2(d))
    one += count * hops * hw.latency
    return 2 * one if kind == "all_reduce" else one


def memory_per_gpu(
    model: ModelSpec,
    mix: Mix,
    seq_len: int,
    micro_batch: int,
    in_flight: int,
) -> dict[str, float]:
    """Bytes per GPU for weights, gradients, optimizer state and activations:
    :func:`lmforge.model.accounting.memory_estimate` (bf16 master weights) under the mix."""
    from lmforge.model import accounting

    cfg = model.config or config_for(model.total_params, model.n_layers, model.d_model)
    sharding = accounting.Sharding(mix.dp, mix.tp, mix.pp, mix.zero, in_flight)
    est = accounting.memory_estimate(
        cfg,
        micro_batch,
        seq_len,
        "bf16",
        activation_checkpointing=mix.recompute,
        fused_attention=True,
        master_weights=True,
        sharding=sharding,
        n_params=model.total_params,
    )
    return {
        "weights": float(est.parameters),
        "grads": float(est.gradients),
        "optimizer": float(est.optimizer),
        "activations": float(est.activations),
    }


def compute_time(
    model: ModelSpec, tokens: float, gpus: int, hw: Hardware, recompute: bool = False
) -> float:
    """6·N_active·tokens / (GPUs · peak · MFU); 8·N_active with recomputation.

    ``model.flops_per_token`` replaces the 6·N_active when given (scaled by 8/6 with
    recomputation: the forward runs twice).
    """
    factor = 8.0 / 6.0 if recompute else 1.0
    return factor * model.train_flops_per_token * tokens / (gpus * hw.peak_flops * hw.mfu)


def dp_comm_time(
    model: ModelSpec,
    mix: Mix,
    hw: Hardware,
    comm_bytes: float = 2.0,
    reduce_bytes: float | None = None,
) -> float:
    """Gradient/parameter traffic over the data-parallel group per step.

    DP and ZeRO-1/2: one all-reduce (≈ reduce-scatter + all-gather) of the replica's parameters,
    2× the bytes; ZeRO-3: all-gather twice plus reduce-scatter, 3×. ``comm_bytes`` per element
    for gathers, ``reduce_bytes`` for gradient reductions (default the same; lmforge reduces in
    fp32, 4). With tp·pp > 1 the data-parallel peers sit in different domains.
    """
    rb = comm_bytes if reduce_bytes is None else reduce_bytes
    p = model.total_params / (mix.tp * mix.pp)
    if mix.dp <= 1:
        return 0.0
    stride_hw = hw
    if mix.tp * mix.pp > 1:
        # dp peers are tp·pp ranks apart: fewer of them share a domain.
        k = max(1, hw.domain_size // (mix.tp * mix.pp))
        stride_hw = dataclasses.replace(hw, domain_size=k)
    if mix.zero >= 3:
        return 2 * collective_time(
            p * comm_bytes, mix.dp, stride_hw, "all_gather"
        ) + collective_time(p * rb, mix.dp, stride_hw, "reduce_scatter")
    return collective_time(p * rb, mix.dp, stride_hw, "all_reduce")


def estimate(
    model: ModelSpec,
    hw: Hardware,
    mix: Mix,
    global_batch: int,
    seq_len: int,
    micro_batch: int = 1,
    comm_bytes: float = 2.0,
    reduce_bytes: float | None = None,
) -> Estimate:
    """Memory, time and MFU of one mix for one step of ``global_batch`` sequences of ``seq_len``."""
    tokens = global_batch * seq_len
    local = global_batch / mix.dp  # sequences per data-parallel rank per step
    m = max(1, int(local // micro_batch))  # micro-batches per step
    in_flight = min(mix.pp, m) if mix.pp > 1 else 1
    mem = memory_per_gpu(model, mix, seq_len, micro_batch, in_flight)
    compute = compute_time(model, tokens, mix.gpus, hw, mix.recompute)
    dp_s = dp_comm_time(model, mix, hw, comm_bytes, reduce_bytes)
    tp_s = 0.0
    if mix.tp > 1:
        elems = 8 * micro_batch * seq_len * model.d_model * (mix.tp - 1) / mix.tp
        tp_bw = hw.nvlink_bw if mix.tp <= hw.domain_size else hw.ib_bw
        tp_s = elems * comm_bytes * (model.n_layers / mix.pp) * m / tp_bw
    pp_s = 0.0
    bubble = 0.0
    if mix.pp > 1:
        pp_bw = hw.nvlink_bw if mix.tp * mix.pp <= hw.domain_size else hw.ib_bw
        pp_s = 2 * micro_batch * seq_len * model.d_model * comm_bytes * m / pp_bw
        bubble = (mix.pp - 1) / m
    busy = (compute + tp_s) * (1 + bubble) + pp_s
    step = _overlapped_step(busy, dp_s, hw.comm_overlap)
    flops = model.train_flops_per_token * tokens
    mfu = flops / (step * mix.gpus * hw.peak_flops) if step > 0 else 0.0
    fits = sum(mem.values()) <= hw.memory_bytes * hw.usable_memory
    # Every data-parallel rank gets the same whole number of sequences: dp divides the batch.
    floor_ok = local >= 1 and global_batch % mix.dp == 0
    if local < 1:
        binding = "batch floor"
    elif not floor_ok:
        binding = "batch split"
    elif not fits:
        binding = "memory"
    elif dp_s > busy:
        binding = "dp-comm"
    else:
        parts = {"compute": compute, "tp-comm": tp_s, "bubble": (compute + tp_s) * bubble}
        binding = max(parts, key=lambda k: parts[k])
    return Estimate(
        mix=mix,
        memory=mem,
        compute_s=compute,
        comm_s={"dp": dp_s, "tp": tp_s, "pp": pp_s},
        bubble=bubble,
        step_s=step,
        mfu=mfu,
        feasible=fits and floor_ok,
        binding=binding,
    )


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    out, d = [], 1
    while d <= min(n, limit):
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


def candidate_mixes(model: ModelSpec, hw: Hardware, gpus: int) -> Iterable[Mix]:
    """Every mix with tp ≤ domain size, pp dividing the layers, zero 0–3, recompute on/off."""
    for tp in _powers_of_two_dividing(gpus, hw.domain_size):
        for pp in [
            p for p in range(1, min(model.n_layers, gpus // tp) + 1) if (gpus // tp) % p == 0
        ]:
            if model.n_layers % pp:
                continue
            dp = gpus // (tp * pp)
            for zero in (0, 1, 2, 3):
                if zero and dp == 1:
                    continue
                for rc in (False, True):
                    yield Mix(dp=dp, tp=tp, pp=pp, zero=zero, recompute=rc)


def plan(
    model: ModelSpec,
    hw: Hardware,
    gpus: int,
    global_batch: int,
    seq_len: int,
    micro_batch: int = 1,
    comm_bytes: float = 2.0,
) -> list[Estimate]:
    """All candidate mixes, feasible ones first, each group fastest first."""
    ests = [
        estimate(model, hw, mix, global_batch, seq_len, micro_batch, comm_bytes)
        for mix in candidate_mixes(model, hw, gpus)
    ]
    return sorted(ests, key=lambda e: (not e.feasible, e.step_s))


def fsdp_times(
    model: ModelSpec,
    hw: Hardware,
    gpus: int,
    global_batch: int,
    seq_len: int,
    comm_bytes: float = 2.0,
) -> tuple[float, float]:
    """(compute, communication) seconds per step of pure FSDP (ZeRO-3, dp = GPUs)."""
    mix = Mix(dp=gpus, zero=3)
    return (
        compute_time(model, global_batch * seq_len, gpus, hw),
        dp_comm_time(model, mix, hw, comm_bytes),
    )


def fsdp_crossover(
    model: ModelSpec,
    hw: Hardware,
    global_batch: int,
    seq_len: int,
    comm_bytes: float = 2.0,
    max_gpus: int = 1 << 20,
) -> float | None:
    """GPU count where pure FSDP's communication time reaches its compute time.

    Found by bisection on the GPU count between 2 and ``max_gpus`` (integers; the curves are
    monotone up to the latency term's ⌈log2⌉ steps); None if communication never catches up. Ignores the batch floor: compare
    the result with ``global_batch`` (the most data-parallel ranks the batch allows).
    """

    def gap(n: float) -> float:
        c, comm = fsdp_times(model, hw, n, global_batch, seq_len, comm_bytes)
        return comm - c

    lo, hi = 2.0, float(max_gpus)
    if gap(hi) < 0:
        return None
    if gap(lo) >= 0:
        return lo
    lo_i, hi_i = 2, max_gpus
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if gap(mid) >= 0:
            hi_i = mid
        else:
            lo_i = mid
    return float(hi_i)


def _strategy_comm(
    strategy: str,
    n_params: float,
    gpus: int,
    hw: Hardware,
    gather_bytes: float,
    reduce_bytes: float,
    n_units: int,
    n_tensors: int,
) -> tuple[float, float]:
    """(overlappable, exposed) communication seconds per step of one lmforge strategy.

    DDP: bucketed (25 MB) fp32 all-reduce during backward, overlappable. ZeRO-1: the same, plus
    :class:`~lmforge.parallel.ShardedOptimizer` broadcasting every parameter tensor from its owner
    after the optimizer step (as many bytes per GPU as an all-gather) — nothing left to overlap it
    with, so it is exposed. FSDP: all-gather forward and backward plus reduce-scatter per unit,
    prefetched under compute.
    """
    if strategy not in ("single", "ddp", "zero1", "fsdp"):
        raise ValueError(f"unknown strategy '{strategy}' (single, ddp, zero1, fsdp)")
    if gpus <= 1 or strategy == "single":
        return 0.0, 0.0
    if strategy == "fsdp":
        comm = 2 * collective_time(n_params * gather_bytes, gpus, hw, "all_gather", n_units)
        comm += collective_time(n_params * reduce_bytes, gpus, hw, "reduce_scatter", n_units)
        return comm, 0.0
    # ddp, zero1
    buckets = max(1, math.ceil(n_params * reduce_bytes / 25e6))
    comm = collective_time(n_params * reduce_bytes, gpus, hw, "all_reduce", buckets)
    exposed = 0.0
    if strategy == "zero1":
        exposed = collective_time(n_params * 4.0, gpus, hw, "all_gather", n_tensors)
    return comm, exposed


def predict_step_time(
    n_params: float,
    tokens_per_step: float,
    gpus: int,
    strategy: str = "ddp",
    hw: Hardware | None = None,
    gather_bytes: float = 2.0,
    reduce_bytes: float = 4.0,
    flops_per_token: float | None = None,
    n_units: int = 14,
    n_tensors: int = 111,
) -> float:
    """Predicted seconds per optimizer step for lmforge's own strategies on ``gpus`` GPUs.

    ``strategy``: ``single``, ``ddp``, ``zero1`` or ``fsdp``. ``tokens_per_step`` is global.
    Compute is ``flops_per_token`` (default 6·N) · tokens / (GPUs · peak · MFU); DDP/FSDP
    communication overlaps compute as far as ``hw.comm_overlap`` says (1: the step is the larger
    of the two), and ZeRO-1's parameter broadcast after the optimizer step is added on top.
    lmforge reduces gradients in fp32 (``reduce_bytes`` 4) and FSDP gathers in the compute
    dtype. ``n_units``: FSDP units (blocks + 2); ``n_tensors``: parameter tensors (one ZeRO-1
    broadcast each; 111 for the GPT-2-small shape); both only feed the latency term. Use a
    calibrated ``hw`` (:data:`HARDWARE`, :func:`calibrate`) to predict a real run;
    ``benchmarks/planner.py --calibration`` prints the comparison with measured H200 steps.
    """
    hw = hw or Hardware()
    fpt = flops_per_token if flops_per_token is not None else 6.0 * n_params
    compute = fpt * tokens_per_step / (gpus * hw.peak_flops * hw.mfu)
    comm, exposed = _strategy_comm(
        strategy, n_params, gpus, hw, gather_bytes, reduce_bytes, n_units, n_tensors
    )
    return _overlapped_step(compute, comm, hw.comm_overlap) + exposed


def calibrate(
    measured_step_s: float,
    model: ModelSpec,
    tokens_per_gpu_step: float,
    hardware: Hardware | None = None,
    *,
    ddp_step_s: float | None = None,
    ddp_gpus: int = 2,
    reduce_bytes: float = 4.0,
    name: str | None = None,
    source: str | None = None,
) -> Hardware:
    """Fit ``hardware`` (default :class:`Hardware`) to measured step times; return the fitted copy.

    MFU: from a single-GPU step with no communication, ``mfu = FLOPs per token · tokens /
    (step · peak)`` (FLOPs from ``model.train_flops_per_token``, so the fitted MFU is in the same
    convention as the predictions that use it). Then :func:`predict_step_time` with the result
    returns ``measured_step_s`` for that point.

    Communication (only with ``ddp_step_s``, a DDP step with the same per-GPU batch on
    ``ddp_gpus`` GPUs of one domain): the time beyond the fitted compute is the exposed
    communication. The fit changes as little as explains it: first the overlap
    (``comm_overlap`` < 1 at nominal bandwidth); if even none would be too little, overlap 0 and
    a lower effective ``nvlink_bw`` (bytes over the time left after the latency term). A DDP step
    no slower than compute keeps perfect overlap. Simplification: one point cannot separate
    overlap from bandwidth, nor from a per-GPU slowdown that is not communication at all (a
    loaded host, clocks) — the effective numbers absorb all of it.

    Exercise: ``pytest tests/test_planner.py -k calibrate``.
    """
    hw = hardware or Hardware()
    if measured_step_s <= 0 or tokens_per_gpu_step <= 0:
        raise ValueError("measured_step_s and tokens_per_gpu_step must be positive")
    flops = model.train_flops_per_token * tokens_per_gpu_step
    mfu = flops / (measured_step_s * hw.peak_flops)
    if mfu > 1:
        raise ValueError(
            f"a {measured_step_s * 1e3:.2f} ms step would be {mfu:.0%} of peak: check the inputs"
        )
    fitted = dataclasses.replace(
        hw,
        mfu=mfu,
        name=name or hw.name,
        source=source or f"calibrate(): {measured_step_s * 1e3:.2f} ms/step single GPU",
    )
    if ddp_step_s is None:
        return fitted
    if not 2 <= ddp_gpus <= hw.domain_size:
        raise ValueError(f"ddp_gpus must be within one domain (2..{hw.domain_size})")
    exposed = ddp_step_s - measured_step_s
    if exposed <= 0:
        return dataclasses.replace(fitted, comm_overlap=1.0)
    n = model.total_params
    comm, _ = _strategy_comm("ddp", n, ddp_gpus, fitted, 2.0, reduce_bytes, 1, 1)
    if exposed <= comm:
        return dataclasses.replace(fitted, comm_overlap=1.0 - exposed / comm)
    # No overlap at all and still too fast: lower the bandwidth until the all-reduce takes the
    # exposed time (the latency term does not depend on it).
    at_inf = dataclasses.replace(fitted, nvlink_bw=math.inf)
    lat, _ = _strategy_comm("ddp", n, ddp_gpus, at_inf, 2.0, reduce_bytes, 1, 1)
    if exposed <= lat:  # pragma: no cover - needs a latency larger than the whole all-reduce
        raise ValueError("the DDP step's extra time is below the modelled collective latency")
    bw = (comm - lat) * fitted.nvlink_bw / (exposed - lat)
    return dataclasses.replace(fitted, comm_overlap=0.0, nvlink_bw=bw)


_EAGER_SRC = (
    "fit by calibrate() to lmforge's 1-GPU eager step on one H200: GPT-2-small shape "
    "(GPT2_SMALL_BENCH), 16×1024 tokens, bf16 autocast, AdamW, torch 2.11, 81.4 ms/step "
    "(201,229 tok/s); measured by the lead with benchmarks/parallel.py, 2026-11-29"
)
_COMPILED_SRC = (
    "fit by calibrate() to lmforge's 1-GPU torch.compile step on one H200: GPT-2-small shape, "
    "32×1024 tokens, bf16 autocast, AdamW, 68.9 ms/step (475k tok/s, 41.1% MFU by "
    "lmforge.model.accounting); measured by the lead with benchmarks/train.py, 2026-11-29"
)

HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(),
    # MFU = 854,654,976 FLOPs/token · 16,384 tokens / (0.0814 s · 989e12) (see _EAGER_SRC).
    "h200-eager": Hardware(name="H200 (eager)", mfu=0.17394, source=_EAGER_SRC),
    # MFU = 854,654,976 · 32,768 / (0.0689 s · 989e12) (see _COMPILED_SRC).
    "h200-compiled": Hardware(name="H200 (compiled)", mfu=0.41098, source=_COMPILED_SRC),
}
"""Named hardware presets: ``h200`` is the issue's assumption (a compiled model at 45% MFU); the
others are fitted to measured steps (their ``source`` says which). Communication stays nominal in
all three (NVLink 450 GB/s, perfect overlap): the fits used single-GPU steps only."""


def format_table(ests: list[Estimate], top: int = 15) -> str:
    """A markdown table of the first ``top`` estimates."""
    rows = [
        "| mix | mem/GPU GB | weights+grads+opt GB | act GB | compute s | dp comm s | tp comm s "
        "| bubble | step s | MFU | binding |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in ests[:top]:
        m = e.memory
        rows.append(
            f"| {e.mix.label()} | {e.memory_total / 1e9:.1f} | "
            f"{(m['weights'] + m['grads'] + m['optimizer']) / 1e9:.1f} | "
            f"{m['activations'] / 1e9:.1f} | {e.compute_s:.3f} | {e.comm_s['dp']:.3f} | "
            f"{e.comm_s['tp']:.3f} | {e.bubble:.2f} | {e.step_s:.3f} | {e.mfu:.1%} | "
            f"{e.binding} |"
        )
    return "\n".join(rows)
