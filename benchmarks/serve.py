"""lmforge.serve on one GPU: the four benchmarks of issue 22, peers in the same run, floors first.

1. decode: single-stream greedy decode, TinyLlama-1.1B shape (random weights, bf16), 128-token
   prompt, 256 new tokens: ms per token of ``Engine(model)`` with its defaults (the headline
   row, with the line saying what it chose), the engine with explicit switches (graphs,
   compile, the decode GEMV vs cuBLAS), and the peers — HF ``generate`` (eager),
   ``lmforge.generate`` (the reference loop) and an independent static-cache Llama decoder
   written in this file without lmforge's modules, under ``torch.compile(mode=
   "reduce-overhead")``. Floor = weight bytes / 4.8 TB/s.
2. throughput: nano-vllm's offline workload, Qwen3-0.6B shape (random weights, bf16), 256
   requests, prompt and output lengths uniform in 100-1024, ignore EOS, temperature 0.6:
   output tokens/s. No peer engine is installed here; the floor is the weight read per decode
   step at the batch the engine runs.
   Before it (``--only prefill``, also run by ``throughput``): the varlen paged prefill kernel
   against the per-sequence SDPA loop on steps of that workload, checked first, then one
   layer's attention and one whole forward step timed (CUDA events, medians, interleaved),
   against the FLOP floor.
3. server: the command a user types, ``lmforge serve --checkpoint DIR --port PORT`` (a
   TinyLlama-shape random-weight checkpoint written first), launched as a subprocess and driven
   by the official ``openai`` client: single-stream TPOT, then 64 concurrent streams × 128
   tokens (output tok/s, TPOT p50/p99, errors); then ``Engine(model)`` with its defaults at
   batch 1 and 64 and the independent compiled peer, and one table of ratios against issue 33's
   targets. ``--only server-cpu --quick``: the same on the CPU with a tiny model (a smoke run;
   it also serves the checkpoint with the engine in a thread of the server, the in-process
   peer of the engine process).
4. speculative: batch-1 greedy decode with a 2-layer draft of the same width and with n-gram
   prompt lookup, k = 4: acceptance and speedup over plain eager decode (random weights: the
   draft has nothing to agree on, so this measures the overhead, not the benefit).

Correctness first: the Triton decode kernel against a float64 reference, and the engine's greedy
tokens (eager and CUDA graphs, with the compiled decode step) against ``lmforge.generate``.
Benchmarks 1 and 2 also run the engine with ``compile=False`` in the same run (the peer for the
compiled step); ``--profile`` adds a torch.profiler pass over 20 decode steps per engine (top-20
CUDA kernels: count and µs per step, share; kernels per step).

    PYTHONPATH=src python benchmarks/serve.py                 # everything (~9 min on an H200)
    PYTHONPATH=src python benchmarks/serve.py --only check,decode,throughput --profile
    PYTHONPATH=src python benchmarks/serve.py --only prefill --profile   # + launch-config sweep
    PYTHONPATH=src python benchmarks/serve.py --only gemv                # decode GEMVs alone
    PYTHONPATH=src python benchmarks/serve.py --only decode,spec --quick
    PYTHONPATH=src python benchmarks/serve.py --only server                # issue 33's targets
    PYTHONPATH=src python benchmarks/serve.py --only server-cpu --quick    # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

# Runs without install; a child of the server benchmark (--_src DIR) runs another checkout's code.
sys.path.insert(
    0,
    sys.argv[sys.argv.index("--_src") + 1]
    if "--_src" in sys.argv
    else str(Path(__file__).resolve().parents[1] / "src"),
)

import torch
import torch.nn.functional as F

from lmforge.bench.timing import cuda_kernel_gaps, cuda_kernel_totals
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams

HBM = 4.8e12  # H200 HBM3e bytes/s
GRAPHS = True  # --no-graphs: every engine decodes eagerly
COMPILE = True  # --no-compile: the engine's decode step is not compiled (the engine before)
PROFILE = False  # --profile: a torch.profiler pass over 20 decode steps per engine

TINYLLAMA = dict(
    vocab_size=32000,
    context_length=2048,
    d_model=2048,
    n_layers=22,
    n_heads=32,
    n_kv_heads=4,
    d_ff=5632,
    rope_theta=10000.0,
)
CPU_SERVER_SHAPE = dict(  # tiny: the engine step is a few ms, so the server's cost shows
    vocab_size=2048, context_length=512, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=256
)
QWEN3_06B = dict(
    vocab_size=151936,
    context_length=4096,
    d_model=1024,
    n_layers=28,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    d_ff=3072,
    qk_norm=True,
    tie_embeddings=True,
    rope_theta=1000000.0,
)


DEVICE = "cuda"  # --server-cpu: the server benchmark on the CPU (fastapi missing on the GPU host)


def _model(shape: dict, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        m = TransformerLM(ModelConfig(**shape), device=DEVICE)
    m = m.to(torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()
    with torch.no_grad():  # random weights whose logits are not flat (so greedy is not ties)
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    return m


def _weight_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _line(s: str) -> None:
    print(s, flush=True)


# ---------------------------------------------------------------- correctness
def check() -> None:
    from lmforge.generate import generate
    from lmforge.serve._attention_triton import num_partitions
    from lmforge.serve.attention import paged_attention_float64, paged_decode

    g = torch.Generator().manual_seed(0)
    s, h, k, e, bs = 8, 32, 4, 64, 16
    lens = [1, 15, 16, 17, 100, 333, 1000, 2047]
    nb = sum(math.ceil(n / bs) for n in lens) + 1
    kc = torch.randn(nb, bs, k, e, generator=g)
    vc = torch.randn(nb, bs, k, e, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + math.ceil(n / bs)])
        used += math.ceil(n / bs)
    w = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(s, h, e, generator=g)
    want = torch.stack(
        [paged_attention_float64(q[i : i + 1], kc, vc, tables[i], n)[0] for i, n in enumerate(lens)]
    )
    for dt in (torch.float32, torch.bfloat16):
        got = paged_decode(
            q.cuda().to(dt), kc.cuda().to(dt), vc.cuda().to(dt), bt.cuda(),
            torch.tensor(lens, dtype=torch.int32, device="cuda"), use_triton=True,
        )  # fmt: skip
        err = float((got.double().cpu() - want).abs().max())
        _line(f"check: Triton paged decode {dt} max |err| vs float64 = {err:.2e} "
              f"(split into {num_partitions(s, k, w, 4)[0]} partitions)")  # fmt: skip
        assert err < (1e-4 if dt == torch.float32 else 3e-2)
    # the throughput shape: 64 sequences x 8 kv-heads (one partition), G = 2, E = 128
    s2, h2, k2, e2 = 64, 16, 8, 128
    lens2 = torch.randint(1, 1025, (s2,), generator=g).tolist()
    nb2 = sum(math.ceil(n / bs) for n in lens2) + 1
    kc2 = torch.randn(nb2, bs, k2, e2, generator=g)
    vc2 = torch.randn(nb2, bs, k2, e2, generator=g)
    tables2, used = [], 0
    for n in lens2:
        tables2.append(list(range(used, used + math.ceil(n / bs))))
        used += math.ceil(n / bs)
    w2 = max(len(t) for t in tables2)
    bt2 = torch.tensor([t + [0] * (w2 - len(t)) for t in tables2], dtype=torch.int32)
    q2 = torch.randn(s2, h2, e2, generator=g)
    want2 = torch.stack([paged_attention_float64(q2[i : i + 1], kc2, vc2, tables2[i], n)[0]
                         for i, n in enumerate(lens2)])  # fmt: skip
    got2 = paged_decode(
        q2.cuda().bfloat16(), kc2.cuda().bfloat16(), vc2.cuda().bfloat16(), bt2.cuda(),
        torch.tensor(lens2, dtype=torch.int32, device="cuda"), use_triton=True,
    )  # fmt: skip
    err2 = float((got2.double().cpu() - want2).abs().max())
    _line(f"check: Triton paged decode bf16, 64 seqs x 8 kv-heads, E=128 (partitions: "
          f"{num_partitions(s2, k2, w2, 4)[0]}) max |err| vs float64 = {err2:.2e}")  # fmt: skip
    assert err2 < 3e-2

    torch.manual_seed(0)
    small = TransformerLM(
        ModelConfig(vocab_size=512, context_length=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2)
    ).cuda().eval()  # fmt: skip
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 50, 17, 120)]
    ref = [generate(small, [p], 16, temperature=0)[0] for p in prompts]
    for graphs in (False, True) if GRAPHS else (False,):
        eng = Engine(small, block_size=16, num_blocks=64, cuda_graphs=graphs, max_num_seqs=8)
        out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        same = [o.outputs[0].token_ids for o in out] == ref
        how = "eager (compile failed)" if eng.decoder is None or eng.decoder.failed else "yes"
        _line(f"check: engine greedy == lmforge.generate (cuda_graphs={graphs}, compiled "
              f"decode: {how}): {same}")  # fmt: skip
        assert same and eng.allocator.num_used == 0
        if graphs:
            assert eng.graphs is not None and eng.graphs.graphs


# ---------------------------------------------------------------- profile
def profile_steps(eng: Engine, label: str, n_steps: int = 20, top: int = 20) -> None:
    """torch.profiler over ``n_steps`` engine steps: the top CUDA kernels per step and the total
    kernel count per step (kernels inside CUDA-graph replays are reported by CUPTI too)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    done = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            if not eng.has_unfinished():
                break
            eng.step()
            done += 1
        torch.cuda.synchronize()
    agg = cuda_kernel_totals(prof)
    n = max(done, 1)
    total_us = sum(v[1] for v in agg.values())
    total_k = sum(v[0] for v in agg.values())
    _line(f"\n### profile: {label}, {done} steps")
    if not agg:
        _line("(the profiler recorded no CUDA kernels)")
        return
    _line(f"kernels per step: {total_k / n:.0f}; GPU busy per step: {total_us / n:.1f} us")
    g = cuda_kernel_gaps(prof)
    # GPU idle between kernels: launch latency inside a graph (short gaps) vs waiting on the host
    _line(f"per step: kernel span {g['span'] / n:.1f} us = busy {g['busy'] / n:.1f} + gaps < 8 us "
          f"{g['short'] / n:.1f} ({g['n_short'] / n:.0f}) + longer gaps {g['long'] / n:.1f} "
          f"({g['n_long'] / n:.1f})")  # fmt: skip
    _line("\n| kernel | count/step | us/step | share |")
    _line("|---|---:|---:|---:|")
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        short = short.replace("|", "/")
        _line(f"| {short} | {cnt / n:.1f} | {us / n:.1f} | {us / max(total_us, 1e-9):.1%} |")


# ---------------------------------------------------------------- 1a. decode GEMVs
# (label, N, K): the projections of a decode step (q/k/v and w1/w3 packed, as the engine runs them)
GEMV_SHAPES = [
    ("TinyLlama q|k|v", 2560, 2048),
    ("TinyLlama o", 2048, 2048),
    ("TinyLlama w1|w3", 11264, 2048),
    ("TinyLlama w2", 2048, 5632),
    ("TinyLlama LM head", 32000, 2048),
    ("Qwen3-0.6B q|k|v", 4096, 1024),
    ("Qwen3-0.6B o", 1024, 2048),
    ("Qwen3-0.6B w1|w3", 6144, 1024),
    ("Qwen3-0.6B w2", 1024, 3072),
    ("Qwen3-0.6B LM head", 151936, 1024),
    ("SmolLM2-135M q|k|v", 960, 576),
    ("SmolLM2-135M o", 576, 576),
    ("SmolLM2-135M w1|w3", 3072, 576),
    ("SmolLM2-135M w2", 576, 1536),
    ("SmolLM2-135M LM head", 49152, 576),
]
_GEMV_WINNERS: dict = {}  # (N, K) -> config that beat the table's in this run's sweep


def _graph_us(fns, reps: int = 15, inner: int = 20) -> list[float]:
    """µs per call of each ``fn(i)`` (i: which weight copy), each captured as one CUDA graph of
    ``inner`` calls (as in a decode step's graph); replays interleaved, CUDA events, medians."""
    graphs = []
    for fn in fns:
        for i in range(inner):  # compile / warm outside the capture
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(inner):
                fn(i)
        graphs.append(g)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for j, g in enumerate(graphs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[j].append(a.elapsed_time(b) * 1e3 / inner)
    return [statistics.median(t) for t in times]


def _weight_copies(n: int, k: int, dtype: torch.dtype, copies: int | None = None) -> list:
    """``copies`` random (N, K) weights; None: enough that consecutive calls never find the
    weight in the 50 MB L2 (a decode step streams 2.2 GB, so its GEMVs never do either)."""
    copies = copies or max(1, math.ceil(256e6 / (n * k * 2)))
    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    return [torch.randn(n, k, device=DEVICE, dtype=dtype, generator=g) * 0.02 + 0.001
            for _ in range(copies)]  # fmt: skip


def _gemv_candidates(n: int, k: int, table_cfg) -> list:
    """The sweep's launches for (N, K): the table's first, then 64/128-row tiles, 64-256-wide
    chunks, splits giving 128-1056 programs, 3 stages (2-4 for 64-row tiles of >= 128-wide
    chunks, and for the table's)."""
    from lmforge.serve._gemv_triton import GemvConfig

    out = [table_cfg]
    for bn, warps in ((64, 4), (128, 4), (128, 8)):
        for bk in (64, 128, 256):
            for split in (1, 2, 4, 8):
                progs = -(-n // bn) * split
                if bk <= k and split <= -(-k // bk) and 128 <= progs <= 1056:
                    # 64-row tiles also 2 and 4 stages deep (3 for the larger tiles' smem)
                    for st in (2, 3, 4) if bn == 64 and bk >= 128 else (3,):
                        out.append(GemvConfig(bn, bk, split, warps, st))
    out += [dataclasses.replace(table_cfg, stages=s) for s in (2, 4)]
    return list(dict.fromkeys(out))


def bench_gemv(quick: bool) -> None:
    """The decode GEMV against cuBLAS (``x @ w.T``) at every projection shape of the three
    models: correctness against float64 first, then µs per call, GB/s and % of the 4.8 TB/s
    floor at M = 1 and 8 rows; then a launch-config sweep of the TinyLlama shapes at M = 1."""
    from lmforge.serve._gemv_triton import TABLE, gemv_config, gemv_partials, gemv_triton

    dtype = torch.bfloat16
    dev = torch.device(DEVICE)
    _line("\n## 1a. decode GEMVs: y (M, N) = x (M, K) @ W (N, K)^T, bf16, fp32 accumulation")
    _line("floor per shape: N*K*2 bytes / 4.8 TB/s; kernel = the split-K partials (their sum "
          "is fused into the consumer in the compiled step); CUDA graphs of 20 calls cycling "
          "weight copies beyond L2; medians of 15 interleaved replays")  # fmt: skip
    for label, n, k in GEMV_SHAPES:
        if gemv_config(n, k, dev) is None:
            continue
        w = _weight_copies(n, k, dtype, copies=1)[0]
        errs = []
        for m in (1, 8):
            x = torch.randn(m, k, device=dev, dtype=dtype) + 0.1
            want = x.double() @ w.double().t()
            errs.append(float((gemv_triton(x, w).double() - want).abs().max() / want.abs().max()))
        _line(f"check: GEMV {label} ({n}x{k}) max |err| / max |y| vs float64: M=1 {errs[0]:.1e}, "
              f"M=8 {errs[1]:.1e}")  # fmt: skip
        assert max(errs) < 1e-2, label
        del w
    _line("\n| shape | N x K | MB | M | floor us | triton us | TB/s | % of 4.8 | cuBLAS us | "
          "TB/s | % of 4.8 | triton faster by | launch (BN, BK, split, warps, stages) |")  # fmt: skip
    _line("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    step: dict[int, list[float]] = {}  # M -> [floor, triton, cuBLAS] µs of one TinyLlama step
    for label, n, k in GEMV_SHAPES:
        ws = _weight_copies(n, k, dtype)
        cfg = gemv_config(n, k, dev)
        wbytes = n * k * 2
        floor = wbytes / HBM * 1e6
        per_step = 1 if "LM head" in label else 22  # TinyLlama: 22 layers, the head once
        for m in (1,) if quick else (1, 8):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            fns = [lambda i, x=x, ws=ws: torch.matmul(x, ws[i % len(ws)].t())]
            if cfg is not None:
                fns.insert(0, lambda i, x=x, ws=ws, cfg=cfg: gemv_partials(x, ws[i % len(ws)], cfg))
            us = _graph_us(fns)
            c_us = us[-1]
            t_us = us[0] if cfg is not None else c_us  # a shape routed to cuBLAS runs cuBLAS
            if label.startswith("TinyLlama"):
                acc = step.setdefault(m, [0.0, 0.0, 0.0])
                for j, v in enumerate((floor, t_us, c_us)):
                    acc[j] += per_step * v
            launch = (f"({cfg.block_n}, {cfg.block_k}, {cfg.split}, {cfg.warps}, {cfg.stages})"
                      if cfg else "cuBLAS (table)")  # fmt: skip
            _line(f"| {label} | {n} x {k} | {wbytes / 1e6:.1f} | {m} | {floor:.2f} | "
                  f"{t_us:.2f} | {wbytes / t_us / 1e6:.2f} | {wbytes / t_us / 1e6 / 4.8:.0%} | "
                  f"{c_us:.2f} | {wbytes / c_us / 1e6:.2f} | {wbytes / c_us / 1e6 / 4.8:.0%} | "
                  f"{c_us / t_us:.2f}x | {launch} |")  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    for m, (floor, t_us, c_us) in step.items():
        _line(f"TinyLlama step's GEMVs (22 x (q|k|v, o, w1|w3, w2) + LM head), M={m}: floor "
              f"{floor:.0f} us, triton {t_us:.0f} us ({floor / t_us:.0%} of the bandwidth), "
              f"cuBLAS {c_us:.0f} us ({floor / c_us:.0%}); triton faster by {c_us / t_us:.2f}x")  # fmt: skip
    # the sweep: the TinyLlama shapes at M = 1 (benchmark 1's batch)
    _line("\n### launch sweep, TinyLlama shapes, M = 1 (us per call; best first, the table's "
          "marked *)")  # fmt: skip
    for label, n, k in GEMV_SHAPES[:5]:
        table_cfg = TABLE.get((n, k)) or gemv_config(n, k, dev)
        if table_cfg is None:
            continue
        ws = _weight_copies(n, k, dtype)
        x = torch.randn(1, k, device=dev, dtype=dtype)
        cands = []
        for c in _gemv_candidates(n, k, table_cfg):  # drop launches this GPU cannot run
            try:
                gemv_partials(x, ws[0], c)
                cands.append(c)
            except Exception as e:
                _line(f"  ({c} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
        fns = [lambda i, c=c, x=x, ws=ws: gemv_partials(x, ws[i % len(ws)], c) for c in cands]
        fns.append(lambda i, x=x, ws=ws: torch.matmul(x, ws[i % len(ws)].t()))
        us = _graph_us(fns, reps=9)
        cublas = us.pop()
        ranked = sorted(zip(us, cands, strict=True), key=lambda t: t[0])
        cells = [f"{'*' if c == table_cfg else ''}({c.block_n},{c.block_k},{c.split},"
                 f"{c.warps},{c.stages}) {t:.2f}" for t, c in ranked[:6]]  # fmt: skip
        best_us, best = ranked[0]
        mine = us[cands.index(table_cfg)] if table_cfg in cands else float("nan")
        _line(f"{label} ({n}x{k}): cuBLAS {cublas:.2f} us; {'; '.join(cells)}; table "
              f"{mine:.2f} us, best {best_us:.2f} us ({mine / best_us:.2f}x)")  # fmt: skip
        if best != table_cfg and best_us < 0.97 * mine:
            _GEMV_WINNERS[(n, k)] = best
        if cublas < 0.97 * best_us:
            _line(f"  -> cuBLAS beats every launch at {label}: the table should route it there")
            _GEMV_WINNERS[(n, k)] = None
        del ws
        torch.cuda.empty_cache()
    if _GEMV_WINNERS:
        _line("sweep winners (TABLE entries to take): " + ", ".join(
            f"({n}, {k}): " + (f"GemvConfig{(c.block_n, c.block_k, c.split, c.warps, c.stages)}"
                               if c else "None (cuBLAS)")
            for (n, k), c in _GEMV_WINNERS.items()))  # fmt: skip


# ---------------------------------------------------------------- 1. decode
def _time_engine_decode(
    model: TransformerLM, prompt: list[int], new: int, graphs: bool, compile: bool
) -> tuple[float, Engine]:
    # a fresh dynamo cache per engine: the rows trace different graphs (GEMV on/off, other
    # launches) and must not run into the recompile limit on decode_forward
    torch._dynamo.reset()
    eng = Engine(model, block_size=16, max_num_seqs=1, cuda_graphs=graphs, num_blocks=256,
                 compile=compile)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    runs = []
    for _ in range(3):
        eng.add_request(prompt, params)
        torch.cuda.synchronize()
        eng.step()  # prefill + first token
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / (new - 1))
    if PROFILE:
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        eng.step()  # prefill
        gemv = eng.decoder is not None and getattr(eng.decoder, "gemv", None) is not None
        on = ", decode GEMV (Triton)" if gemv else (", cuBLAS GEMVs" if compile else "")
        profile_steps(eng, f"decode, graphs={graphs}, compile={compile}{on}")
        while eng.has_unfinished():
            eng.step()
    return statistics.median(runs), eng


@contextlib.contextmanager
def _gemv_patched(off: bool = False, table: dict | None = None):
    """Engines made inside: cuBLAS for every GEMV (``off``), or the decode GEMV with ``table``'s
    launches over the committed ones (kept while the engine runs: the traced op and the
    launch must agree on the split)."""
    from lmforge.serve import _gemv_triton, compiled

    real, saved = compiled._gemv_dtypes, dict(_gemv_triton.TABLE)
    if off:
        compiled._gemv_dtypes = lambda device: None
    if table:
        _gemv_triton.TABLE.update(table)
    try:
        yield
    finally:
        compiled._gemv_dtypes = real
        _gemv_triton.TABLE.clear()
        _gemv_triton.TABLE.update(saved)


def _variant_rows(model: TransformerLM, prompt: list[int], new: int, what: str, rows: list) -> None:
    """The engine with explicit switches (graphs, compile, decode GEMV), beside its defaults."""
    ms, eng = _time_engine_decode(model, prompt, new, graphs=GRAPHS, compile=COMPILE)
    failed = eng.decoder is not None and eng.decoder.failed
    gemv_on = eng.decoder is not None and eng.decoder.gemv is not None
    rows.append((f"lmforge.serve Engine, {what}, compile={COMPILE}"
                 + (", decode GEMV (Triton)" if gemv_on else "")
                 + (" (compile FAILED: eager)" if failed else ""), ms))  # fmt: skip
    del eng
    if gemv_on:  # the decode GEMV's peer in the same run: the same engine on cuBLAS
        with _gemv_patched(off=True):
            ms, eng = _time_engine_decode(model, prompt, new, graphs=GRAPHS, compile=COMPILE)
        rows.append((f"lmforge.serve Engine, {what}, compile={COMPILE}, cuBLAS GEMVs", ms))
        del eng
        if _GEMV_WINNERS:  # the sweep's launches (not in the table yet)
            with _gemv_patched(table=_GEMV_WINNERS):
                ms, eng = _time_engine_decode(model, prompt, new, graphs=GRAPHS, compile=COMPILE)
                del eng
            rows.append((f"lmforge.serve Engine, {what}, compile={COMPILE}, decode GEMV with "
                         f"this run's sweep winners ({len(_GEMV_WINNERS)} shapes)", ms))  # fmt: skip
    if COMPILE:  # the engine as it was before the compiled step, same run
        ms, eng = _time_engine_decode(model, prompt, new, graphs=GRAPHS, compile=False)
        rows.append((f"lmforge.serve Engine, {what}, compile=False", ms))
        del eng


def bench_decode(quick: bool) -> dict:
    from lmforge.generate import generate

    model = _model(TINYLLAMA)
    wb = _weight_bytes(model)
    floor = wb / HBM * 1e3
    _line(f"\n## 1. single-stream decode, TinyLlama shape bf16 ({wb / 1e9:.2f} GB of weights)")
    _line(f"floor: weight read {floor:.3f} ms/token at {HBM / 1e12:.1f} TB/s")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 32000, (128,), generator=g).tolist()
    new = 64 if quick else 256
    rows = []
    # the headline row: what a user gets from Engine(model), nothing set by hand
    (graph_ms,), summary = _engine_decode(model, [[prompt]], new)
    rows.append((f"Engine(model), its defaults ({summary})", graph_ms))
    what = "CUDA graphs" if GRAPHS else "eager"
    try:
        _variant_rows(model, prompt, new, what, rows)
    except Exception as e:  # internals the variants reach into may have moved: say so
        _line(f"engine variant rows skipped: {type(e).__name__}: {str(e)[:200]}")
    eager_ms, eng = _time_engine_decode(model, prompt, min(new, 64), graphs=False, compile=False)
    rows.append(("lmforge.serve Engine, eager, compile=False", eager_ms))
    del eng
    # lmforge.generate reference loop
    n_ref = 16
    generate(model, [prompt], 4, temperature=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(model, [prompt], n_ref, temperature=0)
    torch.cuda.synchronize()
    rows.append(("lmforge.generate (reference loop)", (time.perf_counter() - t0) * 1e3 / n_ref))
    # HF generate
    try:
        import transformers

        from lmforge.hf.convert import lmforge_to_hf_state, model_config_to_hf_config

        hf_cfg = transformers.LlamaConfig(**{
            k: v for k, v in model_config_to_hf_config(model.config).items()
            if k not in ("architectures", "model_type", "torch_dtype")
        })  # fmt: skip
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
        hf.load_state_dict(lmforge_to_hf_state(model.state_dict(), model.config), strict=False)
        hf.cuda()
        ids = torch.tensor([prompt], device="cuda")
        n_hf = 64
        kw = dict(do_sample=False, max_new_tokens=n_hf, min_new_tokens=n_hf, pad_token_id=0)
        hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, **kw)
        torch.cuda.synchronize()
        rows.append((f"HF generate (transformers {transformers.__version__})",
                     (time.perf_counter() - t0) * 1e3 / n_hf))  # fmt: skip
        del hf
    except Exception as e:  # the peer is optional; say why it is missing
        _line(f"HF generate peer skipped: {type(e).__name__}: {e}")
    try:  # the independent peer: no lmforge module, compiled with reduce-overhead
        ms, name = _peer_decode(TINYLLAMA, prompt, new, compile=True)
        rows.append((name, ms))
    except Exception as e:
        _line(f"torch.compile peer skipped: {type(e).__name__}: {str(e)[:200]}")
    _line("\n| implementation | ms/token | vs floor | first row is faster by |")
    _line("|---|---:|---:|---:|")
    for name, ms in rows:
        _line(f"| {name} | {ms:.3f} | {ms / floor:.1f}x | {ms / graph_ms:.2f}x |")
    del model
    torch.cuda.empty_cache()
    return dict(rows)


# ---------------------------------------------------------------- 2a. prefill steps
PEAK_BF16 = 989e12  # H200 dense bf16 tensor-core FLOP/s


def _prefill_steps(in_lens: list[int], budget: int = 16384) -> dict[str, list[tuple[int, int]]]:
    """Two (q_len, ctx_len) steps of the throughput workload as the engine schedules them:
    ``first``: the first step (the first prompts whole, the last one cut at the budget);
    ``mixed``: a later one (200 decode rows, the rest of a prompt cut in the previous step after
    its cached part, then new prompts up to the budget)."""
    g = torch.Generator().manual_seed(1)
    first, left = [], budget
    for n in in_lens:
        t = min(n, left)
        first.append((t, t))
        left -= t
        if left == 0:
            break
    mixed = [(1, int(c)) for c in torch.randint(101, 2048, (200,), generator=g)]
    mixed.append((300, 900))
    left = budget - sum(t for t, _ in mixed)
    for n in in_lens[len(first) :]:
        t = min(n, left)
        mixed.append((t, t))
        left -= t
        if left == 0:
            break
    return {"first": first, "mixed": mixed}


def _cuda_ms(fn, reps: int) -> list[float]:
    """ms of each of ``reps`` calls, CUDA events around the call and a sync after it: the host
    time to launch is counted (on purpose: the per-sequence SDPA loop the prefill kernel
    replaces is launch-bound, and that is its cost in a serving step)."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def _attn_flops(seqs: list[tuple[int, int]], h: int, e: int) -> float:
    """QKᵀ and PV over the (query, key) pairs the bottom-right causal mask keeps."""
    pairs = sum(t * (c - t) + t * (t + 1) / 2 for t, c in seqs)
    return 4.0 * h * e * pairs


def bench_prefill(quick: bool) -> None:
    """The varlen paged prefill kernel against the per-sequence SDPA loop (the torch
    reference) on steps of the throughput workload: correctness, then one layer's attention
    and one whole forward step, CUDA events, medians, interleaved."""
    from lmforge.serve.attention import (
        paged_attention_float64,
        paged_prefill,
        paged_prefill_reference,
        prefill_plan,
    )
    from lmforge.serve.model_runner import PagedKVCache, StepBatch, forward_step

    cfg = ModelConfig(**QWEN3_06B)
    h, k, e, bs = cfg.n_heads, cfg.kv_heads, cfg.head_dim, 16
    g = torch.Generator().manual_seed(0)
    in_lens = torch.randint(100, 1025, (256,), generator=g).tolist()  # bench_throughput's draw
    steps = _prefill_steps(in_lens)
    # the engine's default budget (2048 tokens per step) against the benchmark's 16384
    steps["first, 2048-token budget"] = _prefill_steps(in_lens, 2048)["first"]
    model = _model(QWEN3_06B)
    n_params = model.num_parameters(exclude_embeddings=True)
    _line(
        "\n## 2a. prefill steps of the throughput workload (Qwen3-0.6B shape, bf16, blocks of 16)"
    )
    _line(f"whole workload floor: 2 x {n_params / 1e6:.0f}M non-embedding params x "
          f"{sum(in_lens):,} prompt tokens = {2 * n_params * sum(in_lens):.2e} FLOP = "
          f"{2 * n_params * sum(in_lens) / PEAK_BF16:.3f} s at {PEAK_BF16 / 1e12:.0f} TFLOP/s "
          f"(+ attention {_attn_flops([(n, n) for n in in_lens], h, e) * cfg.n_layers:.2e} FLOP)")  # fmt: skip
    rows, bad = [], []
    for name, seqs in steps.items():
        n_tok = sum(t for t, _ in seqs)
        n_seq = len(seqs)
        # pages: every sequence's blocks, scrambled (as a long-running allocator leaves them)
        nbs = [math.ceil(c / bs) for _, c in seqs]
        nb = sum(nbs) + 1
        perm = torch.randperm(nb - 1, generator=g).add(1).tolist()  # block 0: padding
        tables, used = [], 0
        for m in nbs:
            tables.append(perm[used : used + m])
            used += m
        w = max(nbs)
        bt = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32).cuda()
        q_lens = [t for t, _ in seqs]
        ctx = [c for _, c in seqs]
        ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
        kc = torch.randn(nb, bs, k, e, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(nb, bs, k, e, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(n_tok, h, e, device="cuda", dtype=torch.bfloat16)
        plan = prefill_plan(q_lens, ctx, q.device, head_dim=e)

        def kern(q=q, kc=kc, vc=vc, bt=bt, ctx_t=ctx_t, plan=plan, tables=tables, q_lens=q_lens,
                 ctx=ctx):  # fmt: skip
            return paged_prefill(q, kc, vc, tables, q_lens, ctx, block_table_tensor=bt,
                                 ctx_lens_tensor=ctx_t, plan=plan, use_triton=True)  # fmt: skip

        def loop(q=q, kc=kc, vc=vc, bt=bt, tables=tables, q_lens=q_lens, ctx=ctx):
            return paged_prefill_reference(q, kc, vc, tables, q_lens, ctx, block_table_tensor=bt)

        got, ref = kern(), loop()
        err = float((got.float() - ref.float()).abs().max())
        # float64 on three sequences: the longest whole prompt, a cached-prefix chunk, a decode row
        starts = [0]
        for t in q_lens:
            starts.append(starts[-1] + t)
        whole = [i for i in range(n_seq) if q_lens[i] == ctx[i]]
        chunk = [i for i in range(n_seq) if 1 < q_lens[i] < ctx[i]]
        dec = [i for i in range(n_seq) if q_lens[i] == 1 < ctx[i]]
        picks = sorted({max(whole, key=lambda i: q_lens[i]), *chunk[:1], *dec[:1]})
        kc_h, vc_h, err64 = kc.cpu(), vc.cpu(), 0.0
        for i in picks:
            rows_i = slice(starts[i], starts[i + 1])
            want = paged_attention_float64(q[rows_i].cpu(), kc_h, vc_h, tables[i], ctx[i])
            err64 = max(err64, float((got[rows_i].cpu().double() - want).abs().max()))
        _line(f"check ({name} step: {n_seq} sequences, {n_tok} tokens, "
              f"{sum(1 for t in q_lens if t == 1)} decode rows, tiles {plan.n_long} x "
              f"{plan.block_m} rows + {plan.n_short} x 16): kernel vs SDPA loop max |err| = "
              f"{err:.2e}; vs float64 on sequences {picks} = {err64:.2e}")  # fmt: skip
        if not (err < 5e-2 and err64 < 3e-2):  # vs the loop: two bf16 roundings apart
            bad.append(f"{name}: kernel vs loop {err:.2e} (limit 5e-2), vs float64 {err64:.2e} "
                       "(limit 3e-2)")  # fmt: skip
            _line("check FAILED (the timings still run; the section fails at its end)")
        reps_k, reps_l = (5, 2) if quick else (20, 5)
        kern(), loop()  # warm
        tk, tl_ = [], []
        for _ in range(reps_l):  # interleaved: both see the same clocks and load
            tk += _cuda_ms(kern, reps_k // reps_l)
            tl_ += _cuda_ms(loop, 1)
        mk, ml = statistics.median(tk), statistics.median(tl_)
        fl = _attn_flops(seqs, h, e)
        if PROFILE and name != "first, 2048-token budget":  # ~5 compiles each: --profile only
            _prefill_sweep(name, q, kc, vc, bt, ctx_t, q_lens, ctx, mk)
        kv_bytes = sum(c for _, c in seqs) * k * e * 2 * 2  # each sequence's K and V, bf16
        rows.append((f"{name}: attention, one layer", mk, ml, fl, kv_bytes, n_tok))
        del kc, vc, q

        # one whole forward step (28 layers, the LM head on the last rows), kernel vs loop
        cache = PagedKVCache(cfg.n_layers, nb, bs, k, e, torch.device("cuda"), torch.bfloat16)
        cache.k.normal_()
        cache.v.normal_()
        tok, pos, slots, last = [], [], [], []
        for table, t, c in zip(tables, q_lens, ctx, strict=True):
            for p in range(c - t, c):
                slots.append(table[p // bs] * bs + p % bs)
                pos.append(p)
            tok += torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist()
            last.append(len(tok) - 1)

        def lng(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device="cuda")

        batch = StepBatch(tokens=lng(tok), positions=lng(pos), slots=lng(slots), block_tables=bt,
                          ctx_lens=ctx_t, last_rows=lng(last), q_lens=q_lens, ctx_lens_list=ctx,
                          tables_list=tables)  # fmt: skip

        def step(use_triton: bool, batch=batch, cache=cache):
            with torch.inference_mode():
                return forward_step(model, cache, batch, use_triton=use_triton)

        a, b = step(True), step(False)
        lerr = float((a - b).abs().max() / b.abs().max())
        ts_k, ts_l = [], []
        for _ in range(2 if quick else 3):
            ts_k += _cuda_ms(lambda: step(True), 2)
            ts_l += _cuda_ms(lambda: step(False), 1)
        sk, sl = statistics.median(ts_k), statistics.median(ts_l)
        fl_step = 2 * n_params * n_tok + fl * cfg.n_layers
        _line(f"check ({name} step): forward_step logits, kernel vs loop, max |diff| / max |logit|"
              f" = {lerr:.2e}")  # fmt: skip
        step_bytes = _weight_bytes(model) + kv_bytes * cfg.n_layers
        rows.append((f"{name}: whole forward step", sk, sl, fl_step, step_bytes, n_tok))
        if PROFILE:
            _profile_call(lambda: step(True), f"one {name} prefill step, kernel")
        del cache, batch
        torch.cuda.empty_cache()
    _line("\n| what | tokens | kernel ms | SDPA loop ms | loop / kernel | kernel us/token | "
          "kernel TFLOP/s | floor ms | kernel / floor |")  # fmt: skip
    _line("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for what, mk, ml, fl, nbytes, n_tok in rows:
        floor = max(fl / PEAK_BF16, nbytes / HBM) * 1e3
        _line(f"| {what} | {n_tok} | {mk:.3f} | {ml:.3f} | {ml / mk:.1f}x | "
              f"{mk * 1e3 / n_tok:.2f} | {fl / mk / 1e9:.0f} | {floor:.3f} | {mk / floor:.1f}x |")  # fmt: skip
    _line(f"(floor: the larger of FLOP at {PEAK_BF16 / 1e12:.0f} TFLOP/s and bytes read — "
          f"weights, each sequence's K/V pages — at {HBM / 1e12:.1f} TB/s)")  # fmt: skip
    torch.cuda.empty_cache()
    assert not bad, "prefill kernel check failed: " + "; ".join(bad)


# (block_m, block_n, warps, stages) of the long tiles; of the 16-row (decode-row) tiles
_LONG_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
_SHORT_CONFIGS = [(64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2), (64, 2, 2)]


def _prefill_sweep(name, q, kc, vc, bt, ctx_t, q_lens, ctx, default_ms) -> None:
    """One layer's attention under other launch configs (to pick the defaults from): the long
    tiles' configs on a step without decode rows; on the mixed one, its short (16-row) tiles
    alone under the short tiles' configs. The first row of each is the default."""
    from lmforge.serve._prefill_triton import SHORT_ROWS, paged_prefill_triton, prefill_plan

    _line(f"\nlaunch configs, {name} step, one layer's attention")
    _line("| tiles | block_m | block_n | warps | stages | ms | default / this |")
    _line("|---|---:|---:|---:|---:|---:|---:|")
    if any(t <= SHORT_ROWS for t in q_lens):
        keep = [i for i, t in enumerate(q_lens) if t <= SHORT_ROWS]
        plan = prefill_plan([q_lens[i] for i in keep], [ctx[i] for i in keep], q.device,
                            head_dim=q.shape[-1])  # fmt: skip
        starts = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep]).to(q.device)
        args = (q[rows], kc, vc, bt[keep], ctx_t[keep], plan)
        configs = [(16, bn, w, st) for bn, w, st in _SHORT_CONFIGS]
        label = f"16-row only ({len(keep)} chunks)"
    else:
        configs, label = _LONG_CONFIGS, "long"
    first = None
    for bm, bn, w, st in configs:
        if label == "long":
            args = (q, kc, vc, bt, ctx_t, prefill_plan(q_lens, ctx, q.device, block_m=bm))

        def fn(args=args, bn=bn, w=w, st=st):
            return paged_prefill_triton(*args, block_n=bn, num_warps=w, num_stages=st)

        fn()
        ms = statistics.median(_cuda_ms(fn, 10))
        first = first or ms
        _line(f"| {label} | {bm} | {bn} | {w} | {st} | {ms:.3f} | {first / ms:.2f}x |")
    if label == "long":
        _line(f"(the default through paged_prefill, timed above: {default_ms:.3f} ms)")
    else:  # the peer of the short launch: every chunk in 128-row tiles, one launch
        plan = prefill_plan(q_lens, ctx, q.device, block_m=128, short_tiles=False)
        one = statistics.median(
            _cuda_ms(lambda: paged_prefill_triton(q, kc, vc, bt, ctx_t, plan), 10)
        )
        _line(f"whole {name} step, decode rows in 128-row tiles too (one launch): {one:.3f} ms; "
              f"with the 16-row launch (default): {default_ms:.3f} ms; {one / default_ms:.2f}x")  # fmt: skip


def _profile_call(fn, label: str, top: int = 15) -> None:
    """torch.profiler over one call of ``fn``: its top CUDA kernels and the kernel count."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    agg = cuda_kernel_totals(prof)
    total = sum(v[1] for v in agg.values())
    _line(f"\n### profile: {label}: {sum(v[0] for v in agg.values())} kernels, GPU busy "
          f"{total / 1e3:.2f} ms")  # fmt: skip
    _line("\n| kernel | count | ms | share |")
    _line("|---|---:|---:|---:|")
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        short = (name if len(name) <= 90 else name[:87] + "...").replace("|", "/")
        _line(f"| {short} | {cnt} | {us / 1e3:.3f} | {us / max(total, 1e-9):.1%} |")


# ---------------------------------------------------------------- 2. throughput
def bench_throughput(quick: bool) -> None:
    model = _model(QWEN3_06B)
    wb = _weight_bytes(model)
    n_req = 64 if quick else 256
    g = torch.Generator().manual_seed(0)
    lo, hi = 100, 1024
    in_lens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    out_lens = torch.randint(lo, hi + 1, (n_req,), generator=g).tolist()
    prompts = [torch.randint(0, 151936, (n,), generator=g).tolist() for n in in_lens]
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    _line(
        f"\n## 2. offline throughput, Qwen3-0.6B shape bf16 ({wb / 1e9:.2f} GB), {n_req} requests"
    )
    _line(f"floor: a decode step reads the weights once: {wb / HBM * 1e3:.3f} ms; at batch "
          f"{n_req} that bounds output at {n_req / (wb / HBM):,.0f} tok/s (before KV reads)")  # fmt: skip
    # The whole run's floor: every decode step reads each running sequence's K/V once (prompt +
    # tokens so far), the weights once per step (at least max(out) steps), prefill's GEMM FLOPs.
    from lmforge.serve.model_runner import PagedKVCache

    kv_tok = PagedKVCache.bytes_per_block(model, 1, torch.bfloat16)  # K and V of one token
    kv_s = sum(sum(p + j for j in range(1, n)) for p, n in zip(in_lens, out_lens)) * kv_tok / HBM
    w_s = max(out_lens) * wb / HBM
    n_params = model.num_parameters(exclude_embeddings=True)
    pf_s = 2 * n_params * sum(in_lens) / PEAK_BF16
    total = kv_s + w_s + pf_s
    _line(f"whole-run floor: KV reads {kv_s:.2f} s + weights {w_s:.2f} s + prefill FLOPs "
          f"{pf_s:.2f} s = {total:.2f} s, i.e. {sum(out_lens) / total:,.0f} output tok/s")  # fmt: skip
    rows = []
    for compile in (COMPILE, False) if COMPILE else (False,):
        rows.append(_throughput_run(model, prompts, params, compile))
    _line("\n| engine | requests | output tokens | time (s) | output tok/s | total tok/s | "
          "first row is faster by |")  # fmt: skip
    _line("|---|---:|---:|---:|---:|---:|---:|")
    for name, n_out, dt in rows:
        _line(f"| {name} | {n_req} | {n_out} | {dt:.2f} | {n_out / dt:,.0f} | "
              f"{(n_out + sum(in_lens)) / dt:,.0f} | {dt / rows[0][2]:.2f}x |")  # fmt: skip
    del model
    torch.cuda.empty_cache()


def _throughput_run(model, prompts, params, compile: bool) -> tuple[str, int, float]:
    t0 = time.perf_counter()
    eng = Engine(model, block_size=16, max_num_seqs=256, max_num_batched_tokens=16384,
                 cuda_graphs=GRAPHS, compile=compile)  # fmt: skip
    setup = time.perf_counter() - t0
    eng.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm
    # and a mixed step (a decode row beside a prefill chunk: the prefill kernel's short tiles),
    # so no Triton compile lands inside the timed run
    eng.add_request(prompts[2][:40], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    eng.generate([prompts[3][:50]], SamplingParams(max_tokens=2, ignore_eos=True))
    torch.cuda.synchronize()
    steps0 = eng.stats["steps"]
    # The engine splits its step time: steps that carried prefill ("mixed") vs pure decode
    # (each step ends in a host sync: the sampled tokens' .tolist()).
    before = dict(eng.stats)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    split = {name: [eng.stats[f"{kind}_steps"] - before[f"{kind}_steps"],
                    eng.stats[f"{kind}_s"] - before[f"{kind}_s"]]
             for name, kind in (("prefill", "mixed"), ("decode", "decode"))}  # fmt: skip
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(p.max_tokens for p in params)
    failed = eng.decoder is not None and eng.decoder.failed
    name = f"lmforge.serve Engine, graphs={GRAPHS}, compile={compile}" + (
        " (compile FAILED: eager)" if failed else ""
    )
    _line(f"{name}: KV cache {eng.allocator.num_blocks} blocks of 16; setup (KV alloc + graph "
          f"capture + compile) {setup:.1f} s; steps {eng.stats['steps'] - steps0}, "
          f"preemptions {eng.stats['preemptions']}")  # fmt: skip
    for kind, (n, t) in split.items():
        _line(f"  {kind} steps: {n}, {t:.2f} s ({t / dt:.0%} of the run, "
              f"{t / max(n, 1) * 1e3:.2f} ms/step)")  # fmt: skip
    if PROFILE:  # 20 decode steps with every request admitted and prefilled
        for p, sp in zip(prompts, params, strict=True):
            eng.add_request(p, SamplingParams(temperature=sp.temperature, max_tokens=64,
                                              ignore_eos=True))  # fmt: skip
        while eng.waiting or any(s.n_cached < len(s.tokens) - 1 for s in eng.running):
            eng.step()
        eng.step()
        profile_steps(eng, f"throughput, {len(eng.running)} sequences decoding, compile={compile}")
        for rid in list(eng.requests):
            eng.abort(rid)
    del eng
    torch.cuda.empty_cache()
    return name, n_out, dt


# ---------------------------------------------------------------- 3. the user's server
class _PeerLlama(torch.nn.Module):
    """The independent peer: a static-cache Llama decoder written here with torch alone (no
    lmforge module), one token per call, for ``torch.compile(mode="reduce-overhead")``.

    Fused QKV and gate/up projections (as gpt-fast writes them), RMSNorm in float32, rotate-half
    RoPE, GQA through SDPA over a static (L, 1, K, S, E) cache marked static so the CUDA graph
    keeps its address. Random weights: decode speed does not depend on their values.
    The cached decode is checked against the uncached causal forward (:meth:`logits`).
    """

    def __init__(self, c: dict, max_len: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        d, h, kh, f, v = c["d_model"], c["n_heads"], c["n_kv_heads"], c["d_ff"], c["vocab_size"]
        e = d // h
        self.h, self.kh, self.e = h, kh, e
        g = torch.Generator(device=device).manual_seed(5)

        def w(*shape: int) -> torch.nn.Parameter:
            x = torch.randn(*shape, device=device, generator=g) * shape[-1] ** -0.5
            return torch.nn.Parameter(x.to(dtype), requires_grad=False)

        def ones(n: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.ones(n, device=device, dtype=dtype), requires_grad=False
            )

        self.embed = w(v, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["n_layers"]):
            m = torch.nn.Module()
            m.qkv, m.o = w((h + 2 * kh) * e, d), w(d, h * e)
            m.gate_up, m.down = w(2 * f, d), w(d, f)
            m.n1, m.n2 = ones(d), ones(d)
            self.layers.append(m)
        self.norm, self.head = ones(d), w(v, d)
        inv = 1.0 / c.get("rope_theta", 10000.0) ** (torch.arange(0, e, 2, device=device) / e)
        ang = torch.outer(torch.arange(max_len, device=device).float(), inv)  # (S, E/2)
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())
        shape = (c["n_layers"], 1, kh, max_len, e)
        self.register_buffer("kc", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("vc", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("slots", torch.arange(max_len, device=device))
        torch._dynamo.mark_static_address(self.kc)
        torch._dynamo.mark_static_address(self.vc)

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)  # (T, E/2)
        x1, x2 = x[..., : self.e // 2], x[..., self.e // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, cached: bool) -> torch.Tensor:
        T, h, kh, e = x.shape[1], self.h, self.kh, self.e
        mask = (self.slots <= pos[-1])[None, None, None, :]  # (1, 1, 1, S)
        for i, m in enumerate(self.layers):
            q, k, v = (self._rms(x, m.n1) @ m.qkv.T).split([h * e, kh * e, kh * e], dim=-1)
            q = self._rope(q.view(1, T, h, e).transpose(1, 2), pos)  # (1, H, T, E)
            k = self._rope(k.view(1, T, kh, e).transpose(1, 2), pos)  # (1, K, T, E)
            v = v.view(1, T, kh, e).transpose(1, 2)  # (1, K, T, E)
            if cached:
                self.kc[i].index_copy_(2, pos, k)
                self.vc[i].index_copy_(2, pos, v)
                o = F.scaled_dot_product_attention(
                    q, self.kc[i], self.vc[i], attn_mask=mask, enable_gqa=True
                )  # (1, H, 1, E)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(1, T, h * e) @ m.o.T  # (1, T, D)
            gate, up = (self._rms(x, m.n2) @ m.gate_up.T).chunk(2, dim=-1)  # (1, T, F) each
            x = x + (F.silu(gate) * up) @ m.down.T
        return self._rms(x, self.norm) @ self.head.T  # (1, T, V)

    def forward(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The greedy next token after ``tok`` at position ``pos`` (both (1,)), cache updated."""
        x = F.embedding(tok, self.embed)[None]  # (1, 1, D)
        return self._layers(x, pos, cached=True)[0, -1].argmax()

    def logits(self, toks: torch.Tensor, pos: torch.Tensor, cached: bool) -> torch.Tensor:
        """Logits (T, V) of ``toks`` (T,) at ``pos`` (T,): one cached step, or uncached."""
        x = F.embedding(toks, self.embed)[None]  # (1, T, D)
        return self._layers(x, pos, cached=cached)[0]


def _peer_decode(shape: dict, prompt: list[int], new: int, compile: bool) -> tuple[float, str]:
    """ms/token of the peer (greedy, batch 1) after a token-by-token prefill of ``prompt``."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    # correctness first: the cached decode equals the uncached forward (float32, small)
    small = {**shape, "n_layers": 2}
    chk = _PeerLlama(small, 64, DEVICE, torch.float32)
    toks = torch.tensor(prompt[:16], device=DEVICE)
    with torch.inference_mode():
        want = chk.logits(toks, torch.arange(len(toks), device=DEVICE), cached=False)  # (T, V)
        got = torch.cat([chk.logits(toks[p : p + 1], torch.tensor([p], device=DEVICE), True)
                         for p in range(len(toks))])  # fmt: skip
    err = (got - want).abs().max().item()
    if not err < 1e-2:  # float32 (TF32 matmuls on CUDA allow ~1e-3)
        raise RuntimeError(f"peer check FAILED: cached decode vs full forward, max |diff| {err}")
    del chk
    peer = _PeerLlama(shape, len(prompt) + new + 8, DEVICE, dtype)
    step = torch.compile(peer, mode="reduce-overhead") if compile else peer
    t_c = time.perf_counter()
    with torch.inference_mode():
        for p in range(len(prompt)):  # prefill token by token (compiles and warms up)
            out = step(torch.tensor([prompt[p]], device=DEVICE), torch.tensor([p], device=DEVICE))
        tok = out.clone()
        _sync()
        warm_s = time.perf_counter() - t_c
        t0 = time.perf_counter()
        for i in range(new):
            tok = step(tok.view(1), torch.tensor([len(prompt) + i], device=DEVICE)).clone()
        _sync()
    ms = (time.perf_counter() - t0) * 1e3 / new
    how = "torch.compile reduce-overhead" if compile else "eager (CPU smoke run)"
    return ms, f"independent static-cache Llama, {how} (check passed; warm-up {warm_s:.0f} s)"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _bench_tokenizer(vocab: int) -> object:
    """An lmforge tokenizer whose every id decodes (256 bytes, then ``<i>`` pieces)."""
    from lmforge.tokenizer import Tokenizer

    table = {i: bytes([i]) if i < 256 else f"<{i}>".encode() for i in range(vocab)}
    return Tokenizer(table, [], [])


def _engine_decode(
    model: TransformerLM, batches: list[list[list[int]]], new: int
) -> tuple[list[float], str]:
    """``Engine(model)`` with its defaults (one engine for every batch): per batch of prompts,
    the median ms of a decode step at the full batch (a step that gave as many requests a
    token as any step did: all of them unless the KV cache is short; the first such step is
    dropped, it may carry the last prefill chunk), best of two runs of ``new`` tokens; and the
    line saying what the engine chose."""
    import gc

    eng, summary = _engine_build(model, batches[0][0])
    out = _engine_time(eng, batches, new)
    del eng
    gc.collect()  # the engine's CUDA graphs refer back to it: free its KV cache now
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out, summary


def _engine_build(model: TransformerLM, prompt: list[int], **kw: object) -> tuple[Engine, str]:
    """``Engine(model, **kw)`` (defaults without ``kw``), warmed up by one short request (the
    compile warm-ups and CUDA-graph captures, where a slow start shows); and its summary line."""
    from lmforge.serve.engine_process import engine_summary

    torch._dynamo.reset()
    t_build = time.perf_counter()
    eng = Engine(model, **kw)
    summary = engine_summary(eng)
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _line(f"  Engine(model) built and warmed up in {time.perf_counter() - t_build:.0f} s")
    return eng, summary


def _engine_time(eng: Engine, batches: list[list[list[int]]], new: int) -> list[float]:
    """Per batch of prompts, the median ms of a decode step at the full batch (see
    :func:`_engine_decode`), best of two runs of ``new`` tokens."""
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out = []
    for prompts in batches:
        meds = []
        for _ in range(2):
            for p in prompts:
                eng.add_request(p, params)
            steps = []  # (requests that got a token, seconds)
            while eng.has_unfinished():
                t0 = time.perf_counter()
                got = eng.step()
                _sync()
                steps.append((len(got), time.perf_counter() - t0))
            # the batch the engine reached (all of them when the KV cache holds them all)
            full = max(n for n, _ in steps)
            at_full = [t for n, t in steps if n == full]
            meds.append(statistics.median(at_full[1:] or at_full) * 1e3)
        if full < len(prompts):
            _line(f"note: Engine(model) ran at most {full} of {len(prompts)} requests at once")
        out.append(min(meds))
    return out


def _serve_command(ckpt: str, port: int) -> list[str]:
    import shutil

    exe = shutil.which("lmforge")
    head = [exe] if exe else [sys.executable, "-m", "lmforge"]
    return [*head, "serve", "--checkpoint", ckpt, "--port", str(port)]


def _start(cmd: list[str], port: int, log: Path, timeout: float = 420) -> object:
    import os
    import subprocess

    import httpx

    src = str(Path(__file__).resolve().parents[1] / "src")
    rest = os.environ.get("PYTHONPATH")  # keep carried wheels' site dirs importable
    env = {**os.environ, "PYTHONPATH": f"{src}:{rest}" if rest else src}
    err = log.open("w")
    proc = subprocess.Popen(cmd, env=env, stderr=err, stdout=err)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s")


def _stop(proc: object) -> None:
    import signal

    proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
    try:
        proc.wait(timeout=120)  # type: ignore[attr-defined]
    except Exception:
        proc.kill()  # type: ignore[attr-defined]


async def _one_stream(client, prompt: list[int], new: int) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, completion tokens) of one streamed greedy completion."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    stream = await client.completions.create(
        model=_MODEL, prompt=prompt, max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for ch in stream:
        if ch.choices:
            now = time.perf_counter()
            first = first or now
            last = now
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    if first is None or n < 2:
        return -1.0, -1.0, 0
    return first - t0, (last - first) / (n - 1), n


_MODEL = "bench-ckpt"


def _drive_part(port: int, prompts: list[list[int]], new: int) -> tuple[list, float, float]:
    """One client process's streams: (results, start, end) on the wall clock (``time.time``,
    comparable across processes)."""
    import openai

    async def run() -> tuple[list, float, float]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                                    max_retries=0, timeout=600)  # fmt: skip
        try:
            t0 = time.time()
            res = await asyncio.gather(*(_one_stream(client, p, new) for p in prompts),
                                       return_exceptions=True)  # fmt: skip
            return res, t0, time.time()
        finally:
            await client.close()

    return asyncio.run(run())


def _client_proc(port: int, prompts: list[list[int]], new: int, barrier, out) -> None:
    _drive_part(port, prompts[:1], 2)  # the openai client's first call builds its types: not timed
    barrier.wait()
    res, t0, t1 = _drive_part(port, prompts, new)
    out.put(([r if not isinstance(r, BaseException) else repr(r) for r in res], t0, t1))


def _drive(port: int, prompts: list[list[int]], new: int, per_proc: int = 8) -> dict:
    """Stream ``prompts`` at once through the official openai client; more than ``per_proc``
    streams are spread over client processes of ``per_proc`` each (started together), as 64
    real users are 64 clients: one Python process parsing every stream's chunks (~180 µs a
    chunk through the openai client on a 2-core CPU, measured by ``benchmarks/serve_api_cost.py --client
    openai``) would pace the streams instead of the server."""
    if len(prompts) <= per_proc:
        res, t0, t1 = _drive_part(port, prompts, new)
        wall = t1 - t0
    else:
        ctx = mp.get_context("spawn")  # this process holds a CUDA context: never fork it
        parts = [prompts[i : i + per_proc] for i in range(0, len(prompts), per_proc)]
        barrier, out = ctx.Barrier(len(parts)), ctx.Queue()
        procs = [ctx.Process(target=_client_proc, args=(port, p, new, barrier, out))
                 for p in parts]  # fmt: skip
        for pr in procs:
            pr.start()
        got = [out.get(timeout=900) for _ in procs]
        for pr in procs:
            pr.join(60)
        res = [r if not isinstance(r, str) else RuntimeError(r) for g in got for r in g[0]]
        wall = max(g[2] for g in got) - min(g[1] for g in got)
    ok = [r for r in res if not isinstance(r, BaseException) and r[2] == new]
    tpot = sorted(r[1] * 1e3 for r in ok) or [float("nan")]
    ttft = sorted(r[0] * 1e3 for r in ok) or [float("nan")]

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"tok_s": sum(r[2] for r in ok) / wall, "errors": len(res) - len(ok),
            "tpot50": pct(tpot, 0.5), "tpot99": pct(tpot, 0.99), "ttft50": pct(ttft, 0.5),
            "ttft99": pct(ttft, 0.99)}  # fmt: skip


def _server_steps(port: int) -> tuple[float, float]:
    """(seconds inside engine steps, steps) as the server's /metrics reports them."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    vals = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("lmforge_"))
    return (float(vals["lmforge_engine_step_seconds_sum"]),
            float(vals["lmforge_engine_step_seconds_count"]))  # fmt: skip


def _child_inprocess_server(ckpt: str, port: int) -> None:
    """The same checkpoint served with the engine in a thread of the server's process
    (:class:`EngineLoop`): the in-process peer of the engine process on the CPU."""
    import uvicorn

    from lmforge.serve.loading import load_for_serving
    from lmforge.serve.server import EngineLoop, ServerState, make_server

    model, tok, template, _ = load_for_serving(checkpoint=ckpt, device=DEVICE)
    state = ServerState(EngineLoop(Engine(model, eos_token_id=tok.eot_id)), tok, _MODEL, template)
    server = make_server(state, host="127.0.0.1", port=port, log_level="error")
    assert isinstance(server, uvicorn.Server)
    server.run()


def bench_server(quick: bool) -> None:
    """Issue 33's targets through the user's command: ``lmforge serve --checkpoint DIR`` in a
    subprocess, driven by the official openai client (single stream, then 64 concurrent
    streams), against ``Engine(model)`` with its defaults and the independent compiled peer,
    all in this run."""
    import socket
    import tempfile

    from lmforge.hf import save_as_checkpoint

    cuda = DEVICE == "cuda"
    shape = TINYLLAMA if cuda else CPU_SERVER_SHAPE
    n_streams = 64 if cuda or not quick else 16
    new = 128 if cuda or not quick else 16
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(256, shape["vocab_size"], (128,), generator=g).tolist()
               for _ in range(n_streams)]  # fmt: skip
    model = _model(shape)
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-serve-"))
    ckpt = str(tmp / _MODEL)
    save_as_checkpoint(model.to("cpu"), _bench_tokenizer(shape["vocab_size"]), ckpt, "benchmark")
    model = model.to(DEVICE)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cmd = _serve_command(ckpt, port)
    user_cmd = "lmforge serve --checkpoint DIR --port PORT"
    _line(f"\n## 3. the user's server: `{user_cmd}` ({'TinyLlama shape, bf16' if cuda else shape}"
          f", random weights), official openai client, greedy, 128-token prompts, ignore EOS")  # fmt: skip
    log = tmp / "serve.log"
    t0 = time.perf_counter()
    proc = _start(cmd, port, log)
    start_s = time.perf_counter() - t0
    chose = [x for x in log.read_text().splitlines() if x.startswith("engine")]
    _line(f"server up in {start_s:.0f} s; it printed: {chose[0] if chose else '(no engine line)'}")
    child, port2 = None, None
    if not cuda:  # the in-process peer: the engine in a thread of the server, same checkpoint
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port2 = sk.getsockname()[1]
        here = str(Path(__file__).resolve())
        child = _start([sys.executable, here, "--_child", "inprocess", "--_src",
                        str(Path(here).parents[1] / "src"), "--_device", DEVICE, "--_ckpt", ckpt,
                        "--_port", str(port2)], port2, tmp / "inprocess.log")  # fmt: skip
    singles, inprocs = [], []
    try:
        _drive(port, prompts[:4], 16)  # warm-up
        if port2 is not None:
            _drive(port2, prompts[:4], 16)
        steps = [_server_steps(port)]  # the engine's own step inside the server's process
        for _ in range(3 if quick else 5):  # interleaved: both see the same machine load
            singles.append(_drive(port, prompts[:1], new)["tpot50"])
            steps.append(_server_steps(port))
            if port2 is not None:
                inprocs.append(_drive(port2, prompts[:1], new)["tpot50"])
                steps.append(_server_steps(port))
        load = _drive(port, prompts, new)
        steps.append(_server_steps(port))
    finally:
        _stop(proc)
        if child is not None:
            _stop(child)
    # the same load on the same command with prefill steps eager (the compiled prefill step's
    # A/B: what the switch buys at 64 streams, where arriving prompts interleave with decode)
    eager_load = None
    if cuda or not quick:
        log2 = tmp / "serve-eager-prefill.log"
        proc = _start([*cmd, "--no-compile-prefill"], port, log2)
        try:
            _drive(port, prompts[:4], 16)  # warm-up
            eager_load = _drive(port, prompts, new)
        finally:
            _stop(proc)
    single = statistics.median(singles)
    inproc = statistics.median(inprocs) if inprocs else None
    (eng1, eng64), summary = _engine_decode(model, [prompts[:1], prompts], new)
    del model
    if cuda:
        torch.cuda.empty_cache()
    peer_ms, peer_name = _peer_decode(shape, prompts[0], new, compile=cuda)
    _line(f"Engine(model) chose: {summary}")

    def step_ms(a: tuple[float, float], b: tuple[float, float]) -> float:
        return 1e3 * (b[0] - a[0]) / max(b[1] - a[1], 1)

    _line(f"engine step inside `lmforge serve` (its /metrics): {step_ms(steps[0], steps[-2]):.3f} "
          f"ms over the single-stream runs (TPOT minus this: the hand-off), "
          f"{step_ms(steps[-2], steps[-1]):.3f} ms over the {n_streams}-stream load")  # fmt: skip
    _line(f"64 streams: TTFT p50 / p99 {load['ttft50']:.0f} / {load['ttft99']:.0f} ms, "
          f"TPOT p99 {load['tpot99']:.2f} ms" if n_streams == 64 else
          f"{n_streams} streams: TTFT p50 {load['ttft50']:.0f} ms")  # fmt: skip
    _line("\n| measure | value | against | ratio | target (issue 33) | met |")
    _line("|---|---:|---|---:|---|---|")

    def row(name: str, v: float, ref: str, ratio: float | None, target: str, ok: bool) -> None:
        r = f"{ratio:.2f}x" if ratio is not None else "-"
        _line(f"| {name} | {v:,.3f} | {ref} | {r} | {target} | {'yes' if ok else 'NO'} |")

    row(
        "`lmforge serve` single-stream TPOT (ms)",
        single,
        f"Engine(model) {eng1:.3f} ms/token",
        single / eng1,
        "≤ 1.15x",
        single <= 1.15 * eng1,
    )
    row(
        f"`lmforge serve` {n_streams} streams TPOT p50 (ms)",
        load["tpot50"],
        f"Engine(model) decode step at batch {n_streams} {eng64:.3f} ms",
        load["tpot50"] / eng64,
        "≤ 1.5x",
        load["tpot50"] <= 1.5 * eng64,
    )
    row(
        f"`lmforge serve` {n_streams} streams output tok/s",
        load["tok_s"],
        "-",
        None,
        "≥ 10,000 (H200)",
        load["tok_s"] >= 10_000,
    )
    row(
        f"`lmforge serve` {n_streams} streams errors",
        load["errors"],
        "-",
        None,
        "0",
        load["errors"] == 0,
    )
    row("Engine(model) decode, batch 1 (ms/token)", eng1, f"{peer_name} {peer_ms:.3f} ms/token",
        eng1 / peer_ms, "≤ 1.0x", eng1 <= peer_ms)  # fmt: skip
    if eager_load is not None:
        _line(f"`lmforge serve --no-compile-prefill`, the same {n_streams} streams: TPOT p50 "
              f"{eager_load['tpot50']:.3f} ms, TTFT p50 / p99 {eager_load['ttft50']:.0f} / "
              f"{eager_load['ttft99']:.0f} ms, {eager_load['tok_s']:,.0f} tok/s, "
              f"{eager_load['errors']} errors")  # fmt: skip
        row(f"compiled prefill step (default) vs `--no-compile-prefill`, {n_streams} streams "
            "TPOT p50 (ms)", load["tpot50"], f"eager prefill {eager_load['tpot50']:.3f} ms",
            load["tpot50"] / eager_load["tpot50"], "< 0.98x (earns its complexity)",
            load["tpot50"] < 0.98 * eager_load["tpot50"])  # fmt: skip
    _line(f"single-stream TPOT per request (ms): {', '.join(f'{x:.2f}' for x in singles)}")
    if inproc is not None:
        _line(f"in-process server, same requests interleaved: "
              f"{', '.join(f'{x:.2f}' for x in inprocs)}")  # fmt: skip
        row("engine in a thread of the server (EngineLoop), single-stream TPOT (ms)", inproc,
            f"`lmforge serve` (engine process) {single:.3f} ms", single / inproc,
            "process not slower: ≤ 1.0x (+ noise)", single <= 1.05 * inproc)  # fmt: skip
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def _spawn(role: str, src: str, extra: list[str]):
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", role, "--_src", src,
           "--_device", DEVICE, *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


# ---------------------------------------------------------------- engine host overhead
HOST_SHAPE = dict(  # one tiny layer: the step is host work
    vocab_size=512, context_length=1024, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2
)


def _child_engine_host(n_steps: int) -> None:
    """Host µs per decode step at batch 1, the model's forward stubbed out (a fixed logits
    tensor) and real (one tiny layer); printed as JSON. Runs whichever lmforge is on sys.path."""
    model = _model(HOST_SHAPE)
    out = {}
    for stub in (True, False):
        eng = Engine(model, block_size=16, max_num_seqs=8, num_blocks=256)
        if stub:
            fixed = torch.randn(
                8, HOST_SHAPE["vocab_size"], generator=torch.Generator().manual_seed(0)
            )
            eng._forward = lambda batch, fixed=fixed: fixed[: batch.last_rows.shape[0]]
        prompt = list(range(1, 129))
        times = []
        for _ in range(3):
            eng.add_request(
                prompt, SamplingParams(temperature=0, max_tokens=n_steps, ignore_eos=True)
            )
            eng.step()  # prefill
            while eng.has_unfinished():
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
        times.sort()
        out["stub" if stub else "model"] = times[len(times) // 2] * 1e6
    print(json.dumps(out), flush=True)


def bench_engine_host(quick: bool, baseline_src: str | None = None, rounds: int = 3) -> None:
    """Engine host overhead at batch 1 on the CPU, this checkout vs ``baseline_src``,
    interleaved child processes (each: torch 1 thread)."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    codes = [("this checkout", here)] + ([("baseline " + baseline_src, baseline_src)]
                                         if baseline_src else [])  # fmt: skip
    res: dict[str, list[dict]] = {n: [] for n, _ in codes}
    loads = []
    n_steps = 100 if quick else 300
    for r in range(rounds):
        for name, src in codes if r % 2 == 0 else codes[::-1]:
            child = _spawn("host", src, ["--_n-new", str(n_steps)])
            text, _ = child.communicate(timeout=600)
            res[name].append(json.loads(text.strip().splitlines()[-1]))
            loads.append(Path("/proc/loadavg").read_text().split()[0])
    _line(f"\n## engine host overhead, batch 1, decode steps (CPU, torch 1 thread), {HOST_SHAPE}; "
          f"{rounds} rounds interleaved, median of per-round medians")  # fmt: skip
    _line(f"load average (1 min) after each run: {', '.join(loads)}")
    _line("\n| engine code | µs/step, forward stubbed (host only) | µs/step, 1-layer model |")
    _line("|---|---:|---:|")
    for name, runs in res.items():
        a = statistics.median(x["stub"] for x in runs)
        b = statistics.median(x["model"] for x in runs)
        _line(f"| {name} | {a:.0f} | {b:.0f} |")
    if baseline_src:
        a = statistics.median(x["stub"] for x in res[codes[1][0]])
        b = statistics.median(x["stub"] for x in res[codes[0][0]])
        _line(f"host µs/step: baseline / this checkout = {a / b:.2f}x")


# ---------------------------------------------------------------- 4. speculative
def bench_spec(quick: bool) -> None:
    from lmforge.serve.speculative import DraftModel, NgramDraft, Speculative

    target = _model(TINYLLAMA)
    draft = _model({**TINYLLAMA, "n_layers": 2}, seed=1)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 32000, (128,), generator=g).tolist()
    new = 64 if quick else 128
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    plain = Engine(target, block_size=16, max_num_seqs=1, num_blocks=256)
    want = plain.generate([prompt], params)[0].outputs[0].token_ids
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plain.generate([prompt], params)
    torch.cuda.synchronize()
    base = (time.perf_counter() - t0) * 1e3 / new
    _line(f"\n## 4. speculative decoding, batch 1, TinyLlama shape bf16, greedy, {new} tokens, k=4")
    _line(
        "\n| drafting | acceptance | target forwards | ms/token | speedup vs plain eager | identical |"
    )
    _line("|---|---:|---:|---:|---:|---|")
    _line(f"| none (plain eager engine) | - | {new} | {base:.2f} | 1.00x | yes |")
    for name, d in (
        ("2-layer draft model", DraftModel(draft)),
        ("n-gram prompt lookup", NgramDraft()),
    ):
        spec = Engine(target, block_size=16, max_num_seqs=1, num_blocks=256,
                      speculative=Speculative(d, k=4))  # fmt: skip
        spec.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        stats = spec.speculative.stats = type(spec.speculative.stats)()
        steps0 = spec.stats["steps"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = spec.generate([prompt], params)[0].outputs[0]
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / new
        same = "yes" if out.token_ids == want else "NO"
        _line(f"| {name} | {stats.acceptance:.2f} | {spec.stats['steps'] - steps0} | {ms:.2f} | "
              f"{base / ms:.2f}x | {same} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="check,decode,throughput,server,spec")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--no-graphs", action="store_true", help="engines decode eagerly")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile'd decode step")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over 20 decode steps per engine: top-20 kernels")  # fmt: skip
    ap.add_argument("--server-cpu", action="store_true", help="same as --only server-cpu")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="server: also run another checkout's src (e.g. ../main/src), "
                         "interleaved with this one")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="server: interleaved rounds")
    for hidden in ("--_child", "--_src", "--_device", "--_port", "--_n-new", "--_ckpt"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global GRAPHS, DEVICE, COMPILE, PROFILE
    GRAPHS = not args.no_graphs
    COMPILE = not args.no_compile
    PROFILE = args.profile
    if args._child:
        DEVICE = args._device
        if DEVICE == "cpu":
            torch.set_num_threads(1)  # a shared CPU: the server child and the clients apart
        if args._child == "inprocess":
            _child_inprocess_server(args._ckpt, int(args._port))
        else:
            _child_engine_host(int(args._n_new))
        return 0
    if args.only == "engine-host":
        DEVICE, GRAPHS = "cpu", False
        _line(f"# lmforge.serve engine host overhead on the CPU, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
        _line(f"command: python benchmarks/serve.py {' '.join(sys.argv[1:])}")
        bench_engine_host(args.quick, args.baseline_src, max(args.rounds, 1))
        return 0
    if args.server_cpu or args.only == "server-cpu":
        DEVICE, GRAPHS = "cpu", False
        torch.set_num_threads(1)  # as the children: a shared CPU, clients and servers apart
        _line(f"# lmforge.serve server benchmark on the CPU, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
        _line(f"command: python benchmarks/serve.py {' '.join(sys.argv[1:])}")
        bench_server(args.quick)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/serve.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    _line(f"# lmforge.serve benchmark — {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    _line(f"command: python benchmarks/serve.py {' '.join(sys.argv[1:])}")
    parts = {"check": check, "decode": bench_decode, "throughput": bench_throughput,
             "server": bench_server, "spec": bench_spec}  # fmt: skip
    parts["prefill"] = bench_prefill
    parts["gemv"] = bench_gemv
    only = args.only.split(",")
    if "throughput" in only and "prefill" not in only:  # the prefill kernel's check + timing
        only.insert(only.index("throughput"), "prefill")
    if "decode" in only and "gemv" not in only:  # the decode GEMVs' check + timing + sweep
        only.insert(only.index("decode"), "gemv")
    failed = 0
    for name in only:
        t0 = time.perf_counter()
        fn = parts[name]
        try:
            if name == "check":
                fn()
            else:
                fn(args.quick)
        except Exception as e:  # report and go on: one missing peer must not hide the rest
            import traceback

            traceback.print_exc()
            _line(f"{name}: FAILED ({type(e).__name__}: {e})")
            failed += 1
            if name == "check":
                return 1
        torch.cuda.empty_cache()
        _line(f"({name}: {time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
