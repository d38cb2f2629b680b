"""MLA and MLA + CLA against GQA through the serving engine (``lmforge.serve.Engine``, its
defaults): KV blocks that fit, and batched greedy decode throughput.

Correctness first, on the device (a failed check exits 1; the table still prints): for each
attention kind, a 2-layer fp32 copy of the timed shape serves 3 prompts of different lengths
through the engine (chunked prefill, prefix caching on) and its greedy tokens must equal
``lmforge.generate`` (the reference loop over a contiguous KV cache).

Then, per kind (random weights, bf16, the engine's own memory sizing at
``--kv-fraction``): the KV bytes per token (``lmforge.model.cla.kv_bytes_per_token``), the
blocks the engine allocated, and ``--batch`` sequences of ``--prompt`` fresh tokens (the issue's
shape by default: 64 sequences decoding at 16k context) added at once: the prefill phase (until
every sequence has its first token) timed as a whole, then every full-batch decode step on its
own (CUDA events, host work between steps included): the median decode step in ms and
``batch / step`` tokens/s. Every kind runs the engine's defaults: CUDA graphs around the
compiled decode step (for MLA the latent write and the Triton latent decode kernel,
``lmforge.kernels.mla_decode``, are one custom op inside it); each engine's startup line,
printed above the table, says which path ran, and the correctness check requires it.
``--profile`` prints the kernels of 10 decode steps per kind.

    PYTHONPATH=src python benchmarks/mla_engine.py
    PYTHONPATH=src python benchmarks/mla_engine.py --profile --out runs/mla_engine
    PYTHONPATH=src python benchmarks/mla_engine.py --batch 32 --prompt 1024 --new 64
    PYTHONPATH=src python benchmarks/mla_engine.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__[: __doc__.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4, help="GQA kv-heads (head dim d/H)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="MLA latent C")
    p.add_argument("--rope-dim", type=int, default=64, help="MLA decoupled RoPE dims R")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16384, help="prompt tokens (the decode context)")
    p.add_argument("--new", type=int, default=32, help="tokens decoded per sequence")
    p.add_argument("--repeats", type=int, default=1, help="prefill + decode rounds per kind")
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: the kernels of 10 full-batch decode steps per kind (torch.profiler)",
    )
    p.add_argument("--kv-fraction", type=float, default=0.8)
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated subset of the kinds (GQA-<kv-heads>, MLA, MLA+CLA-2); default all "
        "(on an H100 the three engines' compile and capture alone take most of a 10-minute call)",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p


def _configs(a: argparse.Namespace, context: int) -> dict[str, dict]:
    e = a.d_model // a.heads
    base = dict(vocab_size=32000, context_length=context, d_model=a.d_model,
                n_layers=a.layers, n_heads=a.heads)  # fmt: skip
    mla = dict(attention_type="mla", kv_lora_rank=a.kv_lora_rank, qk_rope_head_dim=a.rope_dim,
               qk_nope_head_dim=e, v_head_dim=e)  # fmt: skip
    return {
        f"GQA-{a.kv_heads}": {**base, "n_kv_heads": a.kv_heads},
        "MLA": {**base, **mla},
        "MLA+CLA-2": {**base, **mla, "kv_share_every": 2},
    }


def _kv_bytes(cfg) -> int:
    from lmforge.model.cla import kv_bytes_per_token

    if cfg.attention_type == "mla":
        return kv_bytes_per_token("mla", n_layers=cfg.n_layers, kv_lora_rank=cfg.kv_lora_rank,
                                  qk_rope_head_dim=cfg.qk_rope_head_dim,
                                  kv_share_every=cfg.kv_share_every)  # fmt: skip
    return kv_bytes_per_token("gqa", n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                              head_dim=int(cfg.head_dim), n_kv_heads=cfg.kv_heads)  # fmt: skip


def _check(kw: dict, device: str) -> bool:
    """Engine greedy tokens == lmforge.generate on a 2-layer fp32 copy of the shape."""
    from lmforge.generate import generate
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    torch.manual_seed(0)
    small = {**kw, "n_layers": 2, "context_length": 128, "vocab_size": 512}
    model = TransformerLM(ModelConfig(**small), device=device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 37, 70)]
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    eng = Engine(model, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)  # chunked
    line = eng.startup_line
    fast = device != "cuda" or ("CUDA graphs on" in line and "compiled decode step on" in line)
    if not fast:
        print(f"  not the fast path: {line}")
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs] == want and fast


class _Clock:
    """Wall time between marks: CUDA events on the GPU (what the device ran, host gaps
    included), perf_counter elsewhere."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return 1e3 * (b - a)


def save_rows(a: argparse.Namespace, rows: list[dict]) -> None:
    """``rows`` so far (with the arguments) to ``a.out``/results.json, when ``--out`` is given."""
    if a.out is None:
        return
    from lmforge.utils.io import atomic_write_text

    body = json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=2)
    atomic_write_text(a.out / "results.json", body)  # makes the folder; never half-written


def prefill_steps(n: int, prompt: int, budget: int = 2048) -> int:
    """A bound on the engine steps that prefill ``n`` prompts of ``prompt`` tokens at ``budget``
    tokens a step (the engine's ``max_num_batched_tokens``): the tokens :func:`time_decode` adds to
    each request, which the model's context must also hold."""
    return -(-n * prompt // budget) + 2


def time_decode(eng, prompts, params, device: str, repeats: int, profile: bool = False) -> dict:
    """One warm-up ``generate`` on two prompts; then, ``repeats`` times, every prompt added at
    once and stepped: the prefill phase (until every request has its first token) timed as a
    whole, then each decode step (all ``len(prompts)`` sequences decoding) on its own. Chunked
    prefill lets the first sequences decode while later ones still prefill (64 prompts of 16k
    take ~500 steps of 2,048 tokens), so each request gets that many tokens on top of
    ``params.max_tokens``: every sequence is still running when the decode phase starts, and
    about ``params.max_tokens`` full-batch steps follow. Fresh prompts each repeat (no
    prefix-cache hits). ``profile``: the last repeat's first 10 decode steps go to
    torch.profiler (benchmarks/serve.py's kernel table) instead of the clock. Returns the
    prefill seconds (median over repeats), the median decode step in ms over every timed
    full-batch decode step, and the most KV blocks the engine held after any step."""
    from lmforge.serve import SamplingParams

    eng.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    extra = prefill_steps(len(prompts), max(map(len, prompts)), eng.max_num_batched_tokens)
    params = dataclasses.replace(params, max_tokens=params.max_tokens + extra)
    clock, prefill_ms, steps_ms, peak = _Clock(device), [], [], 0
    for r in range(repeats):
        g = torch.Generator().manual_seed(100 + r)
        batch = [torch.randint(0, 32000, (len(p),), generator=g).tolist() for p in prompts]
        for i, p in enumerate(batch):
            eng.add_request(p, params, request_id=f"r{r}-{i}")
        got: dict[str, int] = {}
        t0 = clock.mark()
        while len(got) < len(batch) or min(got.values()) < 1:
            for o in eng.step():
                got[o.request_id] = len(o.outputs[0].token_ids) if o.outputs else 0
            peak = max(peak, eng.allocator.num_used)
        prefill_ms.append(clock.ms(t0, clock.mark()))
        if profile and r == repeats - 1:
            import serve  # the sibling script: its profiler table

            serve.profile_steps(eng, "decode steps", n_steps=10, top=12)
        while eng.has_unfinished():
            t0 = clock.mark()
            outs = eng.step()
            t1 = clock.mark()
            peak = max(peak, eng.allocator.num_used)
            if len(outs) == len(batch) and not any(o.finished for o in outs):
                steps_ms.append(clock.ms(t0, t1))  # a full-batch decode step
    if not steps_ms:
        raise RuntimeError(
            "no full-batch decode step was seen: the engine never ran every "
            "sequence in one step (max_num_seqs or the KV pool too small?)"
        )
    return {"prefill_s": statistics.median(prefill_ms) / 1e3,
            "step_ms": statistics.median(steps_ms), "steps": len(steps_ms),
            "peak_blocks": peak}  # fmt: skip


def main() -> int:
    a = _parser().parse_args()
    if a.quick:
        a.d_model, a.layers, a.heads, a.kv_heads = 128, 2, 4, 2
        a.kv_lora_rank, a.rope_dim, a.batch, a.prompt, a.new, a.repeats = 64, 16, 4, 32, 8, 1
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    configs = _configs(a, a.prompt + a.new + prefill_steps(a.batch, a.prompt) + 16)
    if a.kinds:
        want = [k.strip() for k in a.kinds.split(",") if k.strip()]
        unknown = [k for k in want if k not in configs]
        if unknown:
            raise SystemExit(f"unknown kind(s) {', '.join(unknown)}; kinds: {', '.join(configs)}")
        configs = {k: configs[k] for k in want}
    ok = True
    for name, kw in configs.items():
        t0 = time.perf_counter()
        good = _check(kw, a.device)
        ok &= good
        print(f"check {name}: engine greedy == lmforge.generate: {'ok' if good else 'FAILED'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    rows = []
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32000, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for name, kw in configs.items():
        torch.manual_seed(0)
        t0 = time.perf_counter()
        cfg = ModelConfig(**kw)
        model = TransformerLM(cfg, device=a.device, dtype=dtype).eval()
        eng = Engine(model, max_num_seqs=a.batch, kv_memory_fraction=a.kv_fraction)
        built = time.perf_counter() - t0
        t = time_decode(eng, prompts, params, a.device, a.repeats, a.profile and a.device == "cuda")
        rows.append({
            "kind": name,
            "kv_bytes_per_token": _kv_bytes(cfg),
            "kv_blocks": eng.runner.num_blocks,
            "ms_per_step": t["step_ms"],
            "tokens_per_s": a.batch / t["step_ms"] * 1e3,
            "decode_steps_timed": t["steps"],
            "prefill_s": t["prefill_s"],
            "build_s": built,
            "path": eng.startup_line,
        })  # fmt: skip
        r = rows[-1]
        print(f"[{name}] engine built (compile, graphs) in {built:.0f} s; prefill {r['prefill_s']:.1f}"
              f" s; decode {r['ms_per_step']:.3f} ms/step over {r['decode_steps_timed']} full-batch "
              f"steps ({r['tokens_per_s']:.0f} tok/s); {time.perf_counter() - t0:.0f} s in all",
              flush=True)  # fmt: skip
        save_rows(a, rows)  # after every kind: a run cut short keeps what it measured
        del eng, model
        if a.device == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        print(f"  {r['kind']}: {r['path']}")
    print(f"\nd_model {a.d_model}, {a.layers} layers, {a.heads} heads; batch {a.batch} x prompt "
          f"{a.prompt} + {a.new} new; {str(dtype).removeprefix('torch.')}, {a.device}")  # fmt: skip
    print("decode step = median of every full-batch decode step (prefill excluded, timed apart)")
    print(f"{'kind':<12} {'KV B/token':>11} {'KV blocks':>10} {'decode tok/s':>13} "
          f"{'ms/step':>9} {'vs ' + rows[0]['kind']:>12} {'prefill s':>10}")  # fmt: skip
    base = rows[0]["ms_per_step"]  # the first kind run (GQA unless --kinds says otherwise)
    for r in rows:
        print(f"{r['kind']:<12} {r['kv_bytes_per_token']:>11} {r['kv_blocks']:>10} "
              f"{r['tokens_per_s']:>13.1f} {r['ms_per_step']:>9.3f} "
              f"{r['ms_per_step'] / base:>11.2f}x {r['prefill_s']:>10.2f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
