"""RMSNorm launch-config sweep on one GPU: which kernel variant and tile win per row width.

For each shape (bf16 by default): every candidate config is first checked against a float64
reference (y, dx, dw; on N−3 rows so the last tile is ragged), then timed: forward alone, and
backward alone plus forward + backward (the shape's best forward followed by the candidate
backward). Peers measured in the same run: ``F.rms_norm`` (forward, and forward + backward
through autograd) and the device copy of the same bytes (``dst.copy_(x)``). Bytes follow
``lmforge.bench.kernels``: forward = read x + write y (+ w); backward = read x, dy + write dx
(+ w, dw); f+b = both. Timing: CUDA events around each call, median of ``--reps`` after
warmup; a GPU sleep queued first lets the host enqueue every timed call before the GPU starts,
so host overhead never shows as GPU idle time; two input sets alternate so no call reads what
the previous one left in L2.
Stage 1 runs a fixed grid (tile/slab kernels, persistent loops with register prefetch or
``tl.range`` pipelining, several tiles, warps and programs per SM); stage 2 tries neighbours
of the two fastest (evict hints, programs per SM ×2 and ÷2, pipelining depth, Triton dw sum);
the three fastest are then timed again and keep the mean of both medians.
A config that fails to compile or run is skipped with a one-line note. The end prints the
``FWD_CONFIGS`` / ``BWD_CONFIGS`` dicts to paste into ``lmforge/kernels/_rms_norm_triton.py``.
Default run: 4 shapes, ~75 configs each, about 1.5–2.5 min on an H200 (``--budget`` caps it).

    PYTHONPATH=src python benchmarks/rmsnorm_sweep.py
    PYTHONPATH=src python benchmarks/rmsnorm_sweep.py --shapes 32768x2048 --quick --reps 20
    PYTHONPATH=src python benchmarks/rmsnorm_sweep.py --list
    PYTHONPATH=src python benchmarks/rmsnorm_sweep.py --device cpu --shapes 19x200 --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

SHAPES = "32768x768,32768x2048,32768x4096,16384x8192"
TOL = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 4e-2}  # as tests/test_kernels_interp.py
EPS = 1e-5


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ candidates


def _block(d: int) -> int:
    return 1 << (d - 1).bit_length()  # BLOCK_D: next power of two ≥ d


def _warps_for(tile: int, per_thread: Sequence[int]) -> list[int]:
    # num_warps giving each thread `per_thread` values of a `tile`-value tile (4..16 warps).
    out = []
    for e in per_thread:
        w = tile // (32 * e)
        if 4 <= w <= 16 and w not in out:
            out.append(w)
    return out


def fwd_candidates(d: int, quick: bool = False) -> list:
    """Stage-1 forward configs for width ``d``: the default, persistent loops sized so each SM
    keeps 16k or 32k values of x in flight, then tile kernels of 2k–16k values (most promising
    first, in case ``--budget`` cuts the list short)."""
    from lmforge.kernels._rms_norm_triton import FwdConfig, default_config

    block = _block(d)
    loops, tiles = [], []
    for tile in (4096, 8192, 16384):
        if tile < block:
            continue
        for per_sm in (16384, 32768):
            pps = max(1, per_sm // tile)
            for w in _warps_for(tile, (16, 32)):
                for mode in ({"prefetch": True}, {"stages": 2}):
                    loops.append(FwdConfig(tile // block, w, programs_per_sm=pps, **mode))
    for tile in (2048, 4096, 8192, 16384):
        if tile >= block:
            for w in _warps_for(tile, (8, 16, 32, 64)):
                tiles.append(FwdConfig(rows=tile // block, warps=w))
    if quick:
        loops, tiles = loops[::5][:3], tiles[:2]
    return _dedupe([default_config(d), *loops, *tiles])


def bwd_candidates(d: int, quick: bool = False) -> list:
    """Stage-1 backward configs: the default, grid-stride loops with register prefetch or
    ``tl.range`` pipelining sized for 8k or 16k values of (x, dy) in flight per SM, then slab
    kernels with 1, 2 or 4 programs per SM."""
    from lmforge.kernels._rms_norm_triton import BwdConfig, default_config

    block = _block(d)
    loops, slabs = [], []
    for tile in (2048, 4096, 8192, 16384):
        if tile < block or (tile == 16384 and block < 8192):
            continue
        for per_sm in (8192, 16384):
            pps = max(1, per_sm // tile)
            for w in _warps_for(tile, (8, 16) if tile < 8192 else (16, 32)):
                for mode in ({"prefetch": True}, {"stages": 2}):
                    loops.append(BwdConfig(tile // block, w, pps, loop=True, **mode))
    for tile in (2048, 4096, 8192):
        if tile >= block:
            for w in _warps_for(tile, (16,) if tile < 8192 else (16, 32)):
                for pps in (1, 2, 4):
                    slabs.append(BwdConfig(rows=tile // block, warps=w, programs_per_sm=pps))
    if quick:
        loops, slabs = loops[::5][:3], slabs[:1]
    return _dedupe([default_config(d, backward=True), *loops, *slabs])


def neighbours(cfg) -> list:
    """Stage-2 variations of a fast config: evict hints, programs per SM ×2 / ÷2, deeper
    pipelining, and (backward) the Triton dw reduction."""
    from lmforge.kernels._rms_norm_triton import BwdConfig

    out = []
    persistent = cfg.loop if isinstance(cfg, BwdConfig) else cfg.programs_per_sm > 0
    if not persistent and not isinstance(cfg, BwdConfig):  # tile forward: half / double rows
        for rows in (cfg.rows // 2, cfg.rows * 2):
            if rows >= 1:
                out.append(dataclasses.replace(cfg, rows=rows))
    for pps in (cfg.programs_per_sm * 2, cfg.programs_per_sm // 2):
        if persistent or isinstance(cfg, BwdConfig):
            if 1 <= pps <= 16:
                out.append(dataclasses.replace(cfg, programs_per_sm=pps))
    if persistent:
        out.append(dataclasses.replace(cfg, evict=not cfg.evict))
        if cfg.prefetch:
            out.append(dataclasses.replace(cfg, prefetch=False, stages=3))
        else:
            out.append(dataclasses.replace(cfg, stages=cfg.stages + 1))
    if isinstance(cfg, BwdConfig):
        out.append(dataclasses.replace(cfg, dw_reduce="triton" if cfg.dw_reduce == "torch"
                                       else "torch"))  # fmt: skip
    return out


def _dedupe(configs: list) -> list:
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def label(cfg) -> str:
    """Short table label: ``tile r2 w8``, ``loop r4 w8 ×4/SM pf ev``, ``slab r2 w8 ×2/SM``."""
    from lmforge.kernels._rms_norm_triton import BwdConfig

    bwd = isinstance(cfg, BwdConfig)
    kind = ("loop" if cfg.loop else "slab") if bwd else ("loop" if cfg.programs_per_sm else "tile")
    text = f"{kind} r{cfg.rows} w{cfg.warps}"
    if bwd or cfg.programs_per_sm:
        text += f" ×{cfg.programs_per_sm}/SM"
    text += " pf" if cfg.prefetch else (f" st{cfg.stages}" if cfg.stages > 1 else "")
    text += " ev" if cfg.evict else ""
    text += " dw:triton" if bwd and cfg.dw_reduce == "triton" else ""
    return text


# ---------------------------------------------------------------------------------- timing


class Timer:
    """Median milliseconds of ``fn(i)`` over ``reps`` calls (i = call index) after warmup.

    CUDA: a ``torch.cuda._sleep`` as long as the warmup says the timed calls take is queued
    first, so the host has enqueued them all before the GPU reaches them; each call is then
    bracketed by its own pair of events. CPU (interpreter smoke runs): ``perf_counter``.
    """

    def __init__(self, device: str, warmup: int, reps: int) -> None:
        import torch

        self.torch, self.device, self.warmup, self.reps = torch, device, warmup, reps
        self.cycles_per_ms = 0.0
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # load the sleep kernel before timing it
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            torch.cuda.synchronize()
            self.cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)

    def __call__(self, fn: Callable[[int], object]) -> float:
        torch = self.torch
        if self.device != "cuda":
            for i in range(self.warmup):
                fn(i)
            times = []
            for i in range(self.reps):
                t0 = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(self.warmup):
            fn(i)
        torch.cuda.synchronize()
        per_call_ms = (time.perf_counter() - t0) * 1e3 / max(1, self.warmup)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]  # fmt: skip
        sleep_ms = min(100.0, 1.2 * per_call_ms * self.reps + 0.2)
        torch.cuda._sleep(int(sleep_ms * self.cycles_per_ms))
        for i, (s, e) in enumerate(events):
            s.record()
            fn(i)
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def _gbs(n_bytes: float, ms: float) -> float:
    return n_bytes / (ms * 1e-3) / 1e9


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"  # CPU smoke runs measure ~0.001 GB/s


# ------------------------------------------------------------------------------ per shape


@dataclasses.dataclass
class Result:
    """One config's outcome on one shape (``note`` set when it was skipped)."""

    cfg: object
    ms: float = math.inf  # forward, or backward alone
    fb_ms: float = math.inf  # backward configs: forward (best) + this backward
    err: str = ""
    note: str = ""


class ShapeSweep:
    """Inputs, float64 reference and measurements for one (N, D) shape."""

    def __init__(self, n: int, d: int, dtype, device: str, timer: Timer) -> None:
        import torch
        import torch.nn.functional as F

        from lmforge.kernels import _rms_norm_triton as rn
        from lmforge.kernels import rms_norm_reference

        self.torch, self.F, self.rn = torch, F, rn
        self.n, self.d, self.dtype, self.device, self.timer = n, d, dtype, device, timer
        gen = torch.Generator(device=device).manual_seed(n * 7 + d)
        # Two input sets, alternated between timed calls (together > 2× the L2 at every shape).
        self.x = [(torch.randn(n, d, device=device, generator=gen) * 2).to(dtype) for _ in "ab"]
        self.dy = [torch.randn(n, d, device=device, generator=gen).to(dtype) for _ in "ab"]
        self.w = (torch.rand(d, device=device, generator=gen) + 0.5).to(dtype)
        self.rstd = [rn.forward(x, self.w, EPS)[1] for x in self.x]
        el = self.x[0].element_size()
        self.fwd_bytes = el * (2 * n * d + d)
        self.bwd_bytes = el * (3 * n * d + 2 * d)
        # Reference on N−3 rows of the first set: the last row tile is ragged for every ROWS.
        m = max(1, n - 3)
        xr = self.x[0][:m].double().requires_grad_()
        wr = self.w.double().requires_grad_()
        y = rms_norm_reference(xr, wr, EPS)
        dxr, dwr = torch.autograd.grad(y, (xr, wr), self.dy[0][:m].double())
        self.ref = (y.detach(), dxr, dwr)
        self.m = m
        del xr, y

    # -- correctness

    def check(self, cfg) -> str:
        """'' when this config's outputs (forward: y; backward: dx and dw, after the default
        forward) match the float64 reference within the tests' tolerance (relative to the
        output's largest magnitude), else a one-line description of the first failure."""
        torch, rn = self.torch, self.rn
        x, dy = self.x[0][: self.m], self.dy[0][: self.m]
        backward = isinstance(cfg, rn.BwdConfig)
        y, rstd = rn.forward(x, self.w, EPS, config=None if backward else cfg)
        if backward:
            dx, dw = rn.backward(x, self.w, rstd, dy, config=cfg)
            outs = [("dx", dx, self.ref[1]), ("dw", dw, self.ref[2])]
        else:
            outs = [("y", y, self.ref[0])]
        if self.device == "cuda":
            torch.cuda.synchronize()
        tol = TOL[str(self.dtype).split(".")[1]]
        for name, got, want in outs:
            if got.dtype != self.dtype or got.shape != want.shape:
                return f"{name}: {got.dtype} {tuple(got.shape)}, expected {self.dtype}"
            scale = max(1.0, want.abs().max().item())
            err = (got.double() - want).abs().max().item() / scale
            if not err <= tol:  # also catches NaN
                return f"{name} error {err:.3g} × scale {scale:.3g} > {tol}"
        return ""

    # -- timing

    def time_fwd(self, cfg) -> float:
        rn, w = self.rn, self.w
        return self.timer(lambda i: rn.forward(self.x[i % 2], w, EPS, config=cfg))

    def time_bwd(self, cfg, fwd_cfg) -> tuple[float, float]:
        rn, w = self.rn, self.w

        def bwd(i: int):
            return rn.backward(self.x[i % 2], w, self.rstd[i % 2], self.dy[i % 2], config=cfg)

        def fwd_bwd(i: int):
            _, rstd = rn.forward(self.x[i % 2], w, EPS, config=fwd_cfg)
            return rn.backward(self.x[i % 2], w, rstd, self.dy[i % 2], config=cfg)

        return self.timer(bwd), self.timer(fwd_bwd)

    def peers(self) -> dict[str, float]:
        """GB/s of ``F.rms_norm`` forward and forward + backward, and of a copy of x."""
        torch, F, d = self.torch, self.F, self.d
        xs = [x.detach().clone().requires_grad_() for x in self.x]
        w = self.w.detach().clone().requires_grad_()
        out = torch.empty_like(self.x[0])

        def fwd(i: int):
            with torch.no_grad():
                return F.rms_norm(xs[i % 2], (d,), w, EPS)

        def fwd_bwd(i: int):
            y = F.rms_norm(xs[i % 2], (d,), w, EPS)
            return torch.autograd.grad(y, (xs[i % 2], w), self.dy[i % 2])

        copy_ms = self.timer(lambda i: out.copy_(self.x[i % 2]))
        return {
            "torch fwd": _gbs(self.fwd_bytes, self.timer(fwd)),
            "torch f+b": _gbs(self.fwd_bytes + self.bwd_bytes, self.timer(fwd_bwd)),
            "copy": _gbs(2 * self.x[0].numel() * self.x[0].element_size(), copy_ms),
        }


def _precompile_one(task: tuple) -> str:
    # Worker process: launch one config on a small input so Triton compiles it into its disk
    # cache, where the main process then finds it (the cache key depends on D, the dtype and
    # the constexprs, not on N). Returns '' or the error's type.
    d, dtype_name, cfg, device = task
    import torch

    from lmforge.kernels import _rms_norm_triton as rn

    try:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(64, d, device=device).to(dtype)
        w = torch.ones(d, device=device, dtype=dtype)
        if isinstance(cfg, rn.FwdConfig):
            rn.forward(x, w, EPS, config=cfg)
        else:
            rstd = torch.ones(64, device=device)
            rn.backward(x, w, rstd, x, config=cfg)
        if device == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as e:  # the main process reports it when it runs the config itself
        return type(e).__name__


def precompile(
    shapes: list[tuple[int, int]], dtype_name: str, jobs: int, quick: bool, device: str = "cuda"
) -> None:
    """Compile every stage-1 config in ``jobs`` worker processes (Triton compiles one kernel
    at a time per process; the sweep's ~250 kernels would take about a minute serially)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [
        (d, dtype_name, cfg, device)
        for _, d in shapes
        for cfg in fwd_candidates(d, quick) + bwd_candidates(d, quick)
    ]
    t0 = time.monotonic()
    try:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            failed = sum(1 for err in pool.map(_precompile_one, tasks) if err)
    except Exception as e:  # never fatal: the sweep compiles whatever is missing itself
        _say(f"precompile skipped: {type(e).__name__}: {e}")
        return
    _say(f"precompiled {len(tasks)} configs in {jobs} processes in {time.monotonic() - t0:.0f} s"
         + (f" ({failed} failed; reported below)" if failed else ""))  # fmt: skip


def _run_one(fn: Callable[[], Result], cfg, what: str) -> Result:
    # A config that fails to compile or run is skipped, never the sweep.
    try:
        return fn()
    except Exception as e:  # Triton raises compiler and resource errors of many types
        first = (str(e).strip().splitlines() or [""])[0][:120]
        _say(f"    skip {what} {label(cfg)}: {type(e).__name__}: {first}")
        return Result(cfg, note=f"skipped ({type(e).__name__})")


def sweep_shape(sw: ShapeSweep, args, deadline: float) -> dict:
    """Stage 1 then stage 2 for forward, then for backward, until ``deadline`` (monotonic
    seconds); returns results, peers, the best forward and the defaults."""
    from lmforge.kernels._rms_norm_triton import default_config

    d = sw.d
    fwd_default, bwd_default = default_config(d), default_config(d, backward=True)
    peers = sw.peers()
    _say("  peers: " + ", ".join(f"{k} {_num(v)} GB/s" for k, v in peers.items()))

    def fwd_eval(cfg) -> Result:
        def go() -> Result:
            err = sw.check(cfg)
            if err:
                _say(f"    WRONG fwd {label(cfg)}: {err}")
                return Result(cfg, err=err, note="wrong")
            return Result(cfg, ms=sw.time_fwd(cfg))

        return _run_one(go, cfg, "fwd")

    # The forward gets 40% of what is left of this shape's time, the costlier backward the rest.
    fwd_deadline = time.monotonic() + 0.4 * max(0.0, deadline - time.monotonic())
    fwd = _stages(fwd_candidates(d, args.quick), fwd_eval, args, fwd_deadline, "fwd",
                  lambda r: _gbs(sw.fwd_bytes, r.ms))  # fmt: skip
    timed = [r for r in fwd if math.isfinite(r.ms)]
    best_fwd = min(timed, key=lambda r: r.ms).cfg if timed else fwd_default

    def bwd_eval(cfg) -> Result:
        def go() -> Result:
            err = sw.check(cfg)
            if err:
                _say(f"    WRONG bwd {label(cfg)}: {err}")
                return Result(cfg, err=err, note="wrong")
            ms, fb_ms = sw.time_bwd(cfg, best_fwd)
            return Result(cfg, ms=ms, fb_ms=fb_ms)

        return _run_one(go, cfg, "bwd")

    bwd = _stages(bwd_candidates(d, args.quick), bwd_eval, args, deadline, "bwd",
                  lambda r: _gbs(sw.bwd_bytes, r.ms))  # fmt: skip
    return {"fwd": fwd, "bwd": bwd, "peers": peers, "best_fwd": best_fwd,
            "defaults": (fwd_default, bwd_default)}  # fmt: skip


def _stages(first: list, evaluate, args, deadline: float, what: str, rate) -> list[Result]:
    # Stage 1: `first`; stage 2: neighbours of its two fastest. Configs not yet run when the
    # deadline passes are dropped (listed on stderr).
    results: dict = {}

    def run(configs: list, stage: int) -> None:
        todo = [c for c in configs if c not in results]
        for i, cfg in enumerate(todo, 1):
            if time.monotonic() > deadline:
                _say(f"    budget reached: {len(todo) - i + 1} {what} configs of stage {stage} "
                     "not run")  # fmt: skip
                return
            try:
                cfg.validate()
            except ValueError as e:
                _say(f"    skip {what} {label(cfg)}: {e}")
                continue
            r = evaluate(cfg)
            results[cfg] = r
            shown = f"{_num(rate(r))} GB/s" if math.isfinite(r.ms) else r.note
            _say(f"    [{what} s{stage} {i}/{len(todo)}] {label(cfg)}: {shown}")

    def ranked() -> list[Result]:
        return sorted((r for r in results.values() if math.isfinite(r.ms)), key=lambda r: r.ms)

    run(first, 1)
    if not args.quick:
        run(_dedupe([n for r in ranked()[:2] for n in neighbours(r.cfg)]), 2)
        # Time the three fastest once more, back to back, and keep the mean of both medians:
        # the winner should not be whichever config caught a lucky few seconds.
        for r in ranked()[:3] if time.monotonic() < deadline else []:
            again = evaluate(r.cfg)
            if math.isfinite(again.ms):
                r.ms, r.fb_ms = (r.ms + again.ms) / 2, (r.fb_ms + again.fb_ms) / 2
                _say(f"    [{what} again] {label(r.cfg)}: {_num(rate(again))} GB/s")
    return list(results.values())


# ---------------------------------------------------------------------------------- report


def _pct(gbs: float, copy: float) -> str:
    return f"{100 * gbs / copy:.0f}%" if copy > 0 else "-"


def report(n: int, d: int, out: dict, sw: ShapeSweep) -> list[str]:
    """Markdown tables of one shape: forward configs, then backward configs, fastest first."""
    from lmforge.bench.timing import markdown_table

    peers, copy = out["peers"], out["peers"]["copy"]
    fwd_default, bwd_default = out["defaults"]
    lines = [
        f"\n### {n}×{d} {str(sw.dtype).split('.')[1]}: copy {_num(copy)} GB/s; F.rms_norm fwd "
        f"{_num(peers['torch fwd'])} ({_pct(peers['torch fwd'], copy)}), f+b "
        f"{_num(peers['torch f+b'])} ({_pct(peers['torch f+b'], copy)})\n"
    ]
    rows = []
    for r in sorted(out["fwd"], key=lambda r: r.ms):
        gbs = _gbs(sw.fwd_bytes, r.ms) if math.isfinite(r.ms) else r.note
        mark = " (default)" if r.cfg == fwd_default else ""
        rows.append([label(r.cfg) + mark, gbs, _pct(gbs, copy) if r.note == "" else "-"])
    lines.append(markdown_table(["forward config", "GB/s", "of copy"], rows))
    rows = []
    fb_bytes = sw.fwd_bytes + sw.bwd_bytes
    for r in sorted(out["bwd"], key=lambda r: r.ms):
        mark = " (default)" if r.cfg == bwd_default else ""
        if not math.isfinite(r.ms):
            rows.append([label(r.cfg) + mark, r.note, "-", "-"])
            continue
        bwd, fb = _gbs(sw.bwd_bytes, r.ms), _gbs(fb_bytes, r.fb_ms)
        rows.append([label(r.cfg) + mark, bwd, fb, _pct(fb, copy)])
    header = ["backward config", "bwd GB/s", f"f+b GB/s (fwd: {label(out['best_fwd'])})", "of copy"]
    lines.append("\n" + markdown_table(header, rows))
    return lines


def summary(per_shape: list[tuple[int, int, dict, ShapeSweep]]) -> list[str]:
    """Best vs default vs torch per shape, and the two dicts to paste into the kernel module."""
    from lmforge.bench.timing import markdown_table
    from lmforge.kernels._rms_norm_triton import config_repr

    rows, fwd_lines, bwd_lines, keys = [], [], [], set()
    for n, d, out, sw in per_shape:
        copy = out["peers"]["copy"]
        fwd_default, bwd_default = out["defaults"]
        ok_f = [r for r in out["fwd"] if math.isfinite(r.ms)]
        ok_b = [r for r in out["bwd"] if math.isfinite(r.ms)]
        if not ok_f or not ok_b:
            continue
        bf, bb = min(ok_f, key=lambda r: r.ms), min(ok_b, key=lambda r: r.fb_ms)
        df = next((r for r in ok_f if r.cfg == fwd_default), None)
        db = next((r for r in ok_b if r.cfg == bwd_default), None)
        fb_bytes = sw.fwd_bytes + sw.bwd_bytes
        rows.append([
            f"{n}×{d}",
            _gbs(sw.fwd_bytes, df.ms) if df else "-", _gbs(sw.fwd_bytes, bf.ms),
            out["peers"]["torch fwd"],
            _gbs(fb_bytes, db.fb_ms) if db else "-", _gbs(fb_bytes, bb.fb_ms),
            out["peers"]["torch f+b"], copy,
            f"{_pct(_gbs(sw.fwd_bytes, bf.ms), copy)} / {_pct(_gbs(fb_bytes, bb.fb_ms), copy)}",
        ])  # fmt: skip
        key = _block(d)
        if key in keys:
            continue  # one entry per BLOCK_D: the first shape listed with it
        keys.add(key)
        fwd_lines.append(f"    {key}: {config_repr(bf.cfg)},  # {n}×{d}: "
                         f"{_num(_gbs(sw.fwd_bytes, bf.ms))} GB/s")  # fmt: skip
        bwd_lines.append(f"    {key}: {config_repr(bb.cfg)},  # {n}×{d}: f+b "
                         f"{_num(_gbs(fb_bytes, bb.fb_ms))} GB/s, "
                         f"bwd {_num(_gbs(sw.bwd_bytes, bb.ms))}")  # fmt: skip
    header = ["N×D", "default fwd", "best fwd", "torch fwd", "default f+b", "best f+b",
              "torch f+b", "copy", "best of copy (fwd / f+b)"]  # fmt: skip
    return [
        "\n### Summary, GB/s (f+b = best forward + the backward config)\n",
        markdown_table(header, rows),
        "\nPaste over the tables in src/lmforge/kernels/_rms_norm_triton.py:\n",
        "```python",
        "FWD_CONFIGS: dict[int, FwdConfig] = {",
        *fwd_lines,
        "}",
        "BWD_CONFIGS: dict[int, BwdConfig] = {",
        *bwd_lines,
        "}",
        "```",
    ]


# -------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The sweep's flags (``--help`` needs neither CUDA nor Triton)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shapes", default=SHAPES, help="comma list of NxD (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOL))
    p.add_argument("--reps", type=int, default=25, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=4, help="untimed calls before each measurement")
    p.add_argument("--quick", action="store_true", help="a few configs per direction, no stage 2")
    p.add_argument("--budget", type=float, default=140.0,
                   help="seconds for the whole sweep; configs past it are not run")  # fmt: skip
    p.add_argument("--jobs", type=int, default=max(0, min(16, os.cpu_count() or 1) - 1),
                   help="processes compiling stage-1 configs up front (0: none; default "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: Triton's interpreter (TRITON_INTERPRET=1), tiny shapes only")  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the stage-1 configs and exit")
    p.add_argument("--results", metavar="FILE", help="append the tables to this markdown file")
    return p


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            n, d = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"rmsnorm_sweep.py: error: --shapes: {part!r} is not NxD") from None
        if n < 1 or d < 1:
            raise SystemExit(f"rmsnorm_sweep.py: error: --shapes: {part!r} must be positive")
        shapes.append((n, d))
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the sweep, print tables (stdout) and progress (stderr)."""
    args = build_parser().parse_args(argv)
    shapes = _parse_shapes(args.shapes)
    if args.device == "cpu":
        # Triton reads its switch when first imported, so set it before anything imports it.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("rmsnorm_sweep.py: error: --device cpu needs TRITON_INTERPRET=1")
    if args.list:
        for _, d in shapes:
            for what, cands in (("fwd", fwd_candidates(d, args.quick)),
                                ("bwd", bwd_candidates(d, args.quick))):  # fmt: skip
                print(f"D={d} {what} ({len(cands)}): " + "; ".join(map(label, cands)))
        return 0
    import torch

    from lmforge.bench.timing import environment_line

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("rmsnorm_sweep.py: error: no CUDA GPU visible (use --device cpu)")
    dtype = getattr(torch, args.dtype)
    start = time.monotonic()
    command = "python benchmarks/rmsnorm_sweep.py " + " ".join(argv or sys.argv[1:])
    out_lines = [f"`{command}` — {environment_line()}"]
    print(out_lines[0], flush=True)
    if args.device == "cuda" and args.jobs > 1:
        precompile(shapes, args.dtype, args.jobs, args.quick)
    timer = Timer(args.device, args.warmup, args.reps)
    if args.device == "cuda":  # a few hundred ms of copies so clocks are up before timing
        src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_end = time.monotonic() + 0.3
        while time.monotonic() < t_end:
            for _ in range(20):
                dst.copy_(src)
            torch.cuda.synchronize()
        del src, dst
    per_shape = []
    sweep_start = time.monotonic()
    left = max(0.0, args.budget - (sweep_start - start))
    for i, (n, d) in enumerate(shapes):
        _say(f"[{i + 1}/{len(shapes)}] {n}×{d} {args.dtype} ({time.monotonic() - start:.0f} s)")
        deadline = sweep_start + left * (i + 1) / len(shapes)  # unused time rolls over
        sw = ShapeSweep(n, d, dtype, args.device, timer)
        out = sweep_shape(sw, args, deadline)
        lines = report(n, d, out, sw)
        print("\n".join(lines), flush=True)
        out_lines += lines
        per_shape.append((n, d, out, sw))
        del sw.x, sw.dy, sw.rstd, sw.ref
        if args.device == "cuda":
            torch.cuda.empty_cache()
    lines = summary(per_shape)
    print("\n".join(lines), flush=True)
    out_lines += lines
    wrong = sum(1 for *_, out, _ in per_shape for r in out["fwd"] + out["bwd"] if r.err)
    if wrong:
        print(f"\n{wrong} config(s) gave WRONG results (see stderr); never apply those.")
    _say(f"done in {time.monotonic() - start:.0f} s")
    if args.results:
        _append_results(args.results, out_lines)
    return 1 if wrong else 0


def _append_results(path: str, lines: list[str]) -> None:
    import datetime

    from lmforge.utils.io import atomic_write_text

    target = Path(path)
    old = target.read_text(encoding="utf-8") if target.exists() else "# Benchmark results\n"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    entry = f"\n## RMSNorm sweep — {stamp}\n\n" + "\n".join(lines) + "\n"
    atomic_write_text(target, old.rstrip("\n") + "\n" + entry)
    _say(f"appended to {target}")


if __name__ == "__main__":
    raise SystemExit(main())
