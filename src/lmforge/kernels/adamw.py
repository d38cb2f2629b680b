"""Multi-tensor AdamW update in one Triton launch (the optimizer's fast path on CUDA).

Math per tensor (θ parameter, g gradient, m/v moments, t the step count after this step; lr, λ,
β1, β2, ε hyperparameters; c the gradient scale from clipping), skipped entirely unless ``ok``::

    g ← c·g
    m ← m + (1 − β1)·(g − m)                 v ← β2·v + (1 − β2)·g²
    θ ← θ·(1 − lr·λ) + m / (√v / √(1 − β2ᵗ) + ε) · (−lr / (1 − β1ᵗ))

with the per-tensor coefficients computed in float64 and rounded once to float32, as
:func:`adamw_reference_` (lmforge's one AdamW reference, defined first below) and
``lmforge.train.optim.AdamW.step_if`` compute them. ``torch.optim.AdamW`` needs eight passes over
memory when unfused; this kernel reads θ, g, m, v once and writes θ, m, v once (28 bytes a
parameter), all tensors of a group in one launch. The step counts are incremented afterwards by
one multi-tensor add. Exercise: ``pytest tests/test_kernels_interp.py`` (interpreter) and
``pytest -m gpu tests/test_train_gpu.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lmforge.kernels._common import KernelUnsupportedError, interpreting, triton_available

_CACHE_SIZE = 8  # parameter sets whose tables are kept


def adamw_reference_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hp: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """The one AdamW reference: the update in plain torch, one tensor at a time, in place.

    ``hp`` = [lr, λ, β1, β2, ε] (float64), ``steps`` one 0-d (or (1,)) count per tensor, any
    dtype and device, incremented where ``ok``; ``scale`` multiplies every gradient (clipping).
    Gradients are upcast to their parameter's dtype; every coefficient is computed in float64
    and rounded once to that dtype, as every fast path does (``AdamW``'s foreach, compiled and
    gated updates, and :func:`adamw_multi_tensor_`), so in float64 the paths agree to rounding
    and in float32 each is checked against this function run in float64
    (``tests/test_optim.py``, ``tests/test_kernels_interp.py``). ``AdamW(foreach=False)`` is
    this function. ``copies`` (optional, one per parameter) receive the updated parameters in
    their own dtype. Reads ``ok`` on the host: a reference, not a sync-free path."""
    if not bool(ok):
        return
    lr, wd, b1, b2, eps = (float(x) for x in hp.tolist())
    for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        t += 1
        n = float(t.reshape(-1)[0])

        def c(x: float, like: torch.Tensor = p) -> torch.Tensor:
            # A float64 coefficient rounded once to the tensor's dtype.
            return torch.tensor(x, dtype=torch.float64).to(like.dtype)

        g = g.to(p.dtype) * scale.to(p.dtype)
        m.lerp_(g, c(1 - b1, m))  # m ← β1·m + (1 − β1)·g
        v.mul_(c(b2, v)).add_(g * g * c(1 - b2, v))  # v ← β2·v + (1 − β2)·g²
        denom = v.sqrt() / c(math.sqrt(1 - b2**n)) + c(eps)  # √v̂ + ε
        p.mul_(c(1 - lr * wd)).add_(m / denom * c(-lr / (1 - b1**n)))  # decay, then the step
        if copies is not None:
            copies[i].copy_(p)


def adamw_supported(
    *tensor_lists: Sequence[torch.Tensor], copies: Sequence[torch.Tensor] | None = None
) -> str | None:
    """None when :func:`adamw_multi_tensor_` can run on these lists (params, grads, moments)
    and ``copies``, else the reason: Triton, CUDA (or the interpreter), contiguous, one device;
    everything float32 except, with copies, the gradients (float32, or all in the copies'
    dtype) and the copies (all bf16 or all fp16)."""
    if not triton_available():
        return "the Triton path needs the 'triton' package"
    lists = list(tensor_lists)
    grads = lists[1] if len(lists) > 1 else []
    grad_dtypes = {torch.float32}  # without copies
    if copies is not None:
        low = {c.dtype for c in copies}
        if len(low) > 1 or not low <= {torch.bfloat16, torch.float16}:
            return f"copies must be all bf16 or all fp16, got {sorted(map(str, low))}"
        dtypes = {g.dtype for g in grads}
        grad_dtypes = low | {torch.float32}
        if len(dtypes) > 1 or not dtypes <= grad_dtypes:
            return f"gradients must be float32 or the copies' dtype, got {sorted(map(str, dtypes))}"
    devices = set()
    for i, ts in enumerate([*lists, copies or []]):
        for x in ts:
            if i != 1 and i != len(lists) and x.dtype != torch.float32:
                return f"tensors must be float32, got {x.dtype}"
            if i == 1 and x.dtype not in grad_dtypes:
                return f"tensors must be float32, got {x.dtype}"
            if not x.is_contiguous():
                return "tensors must be contiguous"
            if x.device.type != "cuda" and not interpreting():
                return f"the Triton path needs CUDA tensors, got device {x.device}"
            devices.add(x.device)
    if len(devices) > 1:
        return f"tensors on different devices {sorted(map(str, devices))}"
    return None


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned, so the copy is asynchronous; the caching host allocator keeps the block until the
    # copy has run.
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


_chunks: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _chunk_tables(
    numels: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (numel per tensor, tensor index per chunk, first element per chunk) on the device; they
    # depend on the shapes only, so they are built once per parameter set.
    from lmforge.kernels import _adamw_triton

    chunk = _adamw_triton.BLOCK * _adamw_triton.SLICES
    key = (device, numels, chunk)
    tabs = _chunks.get(key)
    if tabs is None:
        counts = torch.tensor([-(-k // chunk) for k in numels], dtype=torch.int64)
        tensor_idx = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
        firsts = torch.cumsum(counts, 0) - counts  # first chunk of each tensor
        starts = (torch.arange(int(counts.sum()), dtype=torch.int64) - firsts[tensor_idx]) * chunk
        host = (torch.tensor(numels, dtype=torch.int64), tensor_idx, starts)
        tabs = _chunks[key] = tuple(_to_device(h, device) for h in host)  # type: ignore[assignment]
    return tabs


class _AddressTable:
    """The (rows, n) int64 address table (θ, g, m, v, t[, copy]) of one parameter set on the
    device.

    Gradients are freed and reallocated every step and may land elsewhere, so the table is
    rewritten whenever the addresses change — from a small ring of pinned host buffers, each
    reused only after the copy that read it has run (an event recorded ``_RING`` updates ago).
    No per-step pinned allocation, which would synchronise the host with the device.

    Inside a CUDA-graph capture the copy becomes a node of the graph that every replay runs
    again, so it reads from a pinned buffer of its own that nothing rewrites afterwards (one
    capture per table: a second capture would change the first graph's source). The table is
    then marked stale, so the next eager update writes it again whatever the addresses.
    """

    def __init__(self, n: int, device: torch.device, rows: int = 5) -> None:
        self.device = device
        self.addrs: tuple[int, ...] | None = None
        self.table = torch.empty((rows, n), dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        shape = (rows, n)
        self.host = [torch.empty(shape, dtype=torch.int64, pin_memory=pin) for _ in range(_RING)]
        self.graph_host = torch.empty(shape, dtype=torch.int64, pin_memory=pin)
        self.events: list = [None] * _RING
        self.slot = 0

    def update(self, addrs: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.graph_host.view(-1).copy_(torch.tensor(addrs, dtype=torch.int64))
            self.table.copy_(self.graph_host, non_blocking=True)
            self.addrs = None  # what the table holds now depends on which graph ran last
        elif addrs != self.addrs:
            host, event = self.host[self.slot], self.events[self.slot]
            if event is not None:
                event.synchronize()  # normally long done: the host runs ≤ a step or two ahead
            host.view(-1).copy_(torch.tensor(addrs, dtype=torch.int64))
            self.table.copy_(host, non_blocking=True)
            if self.device.type == "cuda":
                self.events[self.slot] = torch.cuda.Event()
                self.events[self.slot].record()
            self.slot = (self.slot + 1) % _RING
            self.addrs = addrs
        return self.table


_RING = 4
_address_tables: dict[tuple, _AddressTable] = {}


def adamw_multi_tensor_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hp: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """One AdamW update of every (θ, g, m, v) in one Triton launch, in place, where the 0-d bool
    ``ok`` holds (nothing at all where it does not); arguments as :func:`adamw_reference_`.

    Master weights: with ``copies`` (the model's bf16 or fp16 weights, one per fp32 parameter
    θ) the gradients may be in the copies' dtype; each is upcast as it is read, and the kernel
    writes every copy from the new θ in the same pass (round to nearest even, as ``copy_``).

    Float32 contiguous tensors on one CUDA device (or CPU under ``TRITON_INTERPRET=1``); raises
    :class:`KernelUnsupportedError` naming the constraint otherwise. Never reads a device value
    on the host (no sync). The address tables are copied to the device when the tensors'
    addresses change (cached otherwise); inside a CUDA-graph capture that copy is part of the
    graph, from a pinned buffer kept for it (see :class:`_AddressTable`)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    n = len(params)
    rows = (*lists, steps) if copies is None else (*lists, steps, copies)
    if any(len(x) != n for x in rows):
        raise KernelUnsupportedError(
            "adamw: params, grads, moments, steps and copies differ in length"
        )
    if n == 0:
        return
    addrs = tuple(x.data_ptr() for ts in rows for x in ts)
    device = params[0].device
    numels = tuple(p.numel() for p in params)
    # One table per parameter set (the parameters' addresses and shapes identify it).
    key = (device, addrs[:n], numels, len(rows))
    table = _address_tables.get(key)
    if table is None or table.addrs != addrs:  # checked whenever an address moves (or after
        # a capture)
        _check(lists, steps, hp, addrs, copies)
        if table is None:
            if len(_address_tables) >= _CACHE_SIZE:
                _address_tables.pop(next(iter(_address_tables)))
            table = _address_tables[key] = _AddressTable(n, device, len(rows))
    tables = table.update(addrs)
    numel, chunk_tensor, chunk_start = _chunk_tables(numels, device)
    from lmforge.kernels import _adamw_triton

    ok = ok.to(device=device, dtype=torch.bool)
    _adamw_triton.launch(
        tables,
        numel,
        chunk_tensor,
        chunk_start,
        hp.to(device),
        ok,
        scale.to(device=device, dtype=torch.float32),
        str(grads[0].dtype).removeprefix("torch."),
        None if copies is None else str(copies[0].dtype).removeprefix("torch."),
    )
    # The list form: the (Tensor[], Tensor) form reads its scalar on the host, a device sync.
    one = ok.to(torch.float64)
    torch._foreach_add_(list(steps), [one] * n)


def _check(lists, steps, hp: torch.Tensor, addrs: tuple[int, ...], copies) -> None:
    reason = adamw_supported(*lists, copies=copies)
    if reason is not None:
        raise KernelUnsupportedError(f"adamw: {reason}")
    cs = copies if copies is not None else lists[0]
    for p, g, m, v, t, c in zip(*lists, steps, cs):
        if not (p.shape == g.shape == m.shape == v.shape == c.shape):
            raise KernelUnsupportedError(
                f"adamw: shapes differ: {tuple(p.shape)}, {tuple(g.shape)}, "
                f"{tuple(m.shape)}, {tuple(v.shape)}, {tuple(c.shape)}"
            )
        if t.dtype != torch.float64 or t.numel() != 1 or t.device != p.device:
            raise KernelUnsupportedError("adamw: step counts must be one float64 value each")
    if hp.dtype != torch.float64 or hp.numel() != 5:
        raise KernelUnsupportedError("adamw: hp must be float64 [lr, weight_decay, b1, b2, eps]")
    if any(a % 16 for a in addrs):
        raise KernelUnsupportedError("adamw: tensors must start at 16-byte aligned addresses")
