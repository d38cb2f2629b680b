"""Hybrid layer patterns through the serving engine (``lmforge.serve.Engine``, its defaults)
against full attention: memory per sequence and batched greedy decode throughput.

Correctness first, on the device (a failed check exits 1; the table still prints): for each
pattern, a 4-layer fp32 copy of the timed shape serves 3 prompts of different lengths through
the engine (chunked prefill, a cache small enough to preempt) and its greedy tokens must equal
``lmforge.generate`` (the reference loop: contiguous KV cache, window masks, recurrent states).

Then, per pattern (random weights, bf16, the engine's own memory sizing at ``--kv-fraction``):
the KV bytes per token and recurrent-state bytes per sequence the engine reports, and
``--batch`` sequences of ``--prompt`` tokens decoding ``--new`` tokens each: median over
``--repeats`` runs (after one warmup run) of ``Engine.generate`` between CUDA events, as
generated tokens/s and ms per decode step (prefill included). Every pattern runs the engine's
defaults: CUDA graphs around the compiled decode step (linear layers' slot-state recurrence,
conv-state write and W's window decode as custom ops inside it, :mod:`lmforge.serve.compiled`);
full attention (``A``) is the peer. ``A eager`` and ``GGGA eager`` run the same models without
graphs or compile, so the table splits the gap into graphs+compile and the mixers themselves.
S (DeepSeek sparse attention) selects the top ``--topk`` keys of the lightning indexer inside
the compiled step too. The startup line of each engine (printed above the table) says which path ran.
``--patterns`` picks a subset (each compiled engine costs a compile and a capture).

    PYTHONPATH=src python benchmarks/serve_hybrid.py
    PYTHONPATH=src python benchmarks/serve_hybrid.py --batch 64 --prompt 2048 --out runs/serve_hybrid
    PYTHONPATH=src python benchmarks/serve_hybrid.py --patterns A,GGGA,GGGA-eager
    PYTHONPATH=src python benchmarks/serve_hybrid.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch

PATTERNS = {"A": "A", "A eager": "A", "GGGA": "GGGA", "GGGA eager": "GGGA", "MMMA": "MMMA",
            "LLLA": "LLLA", "WWWA": "WWWA", "GMWA": "GMWA", "SSSA": "SSSA"}  # fmt: skip


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
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--window", type=int, default=512, help="W layers' window")
    p.add_argument("--topk", type=int, default=256, help="S layers' keys per query (DSA)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.8)
    p.add_argument("--patterns", default=",".join(k.replace(" ", "-") for k in PATTERNS),
                   help="comma-separated rows to run (default: all)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p


def _kw(a: argparse.Namespace, layers: str, context: int) -> dict:
    return dict(vocab_size=32000, context_length=context, d_model=a.d_model, n_layers=a.layers,
                n_heads=a.heads, n_kv_heads=a.kv_heads, layers=layers, window=a.window,
                ssm_head_dim=64, dsa_topk=a.topk)  # fmt: skip


def _check(kw: dict, device: str) -> bool:
    """Engine greedy tokens == lmforge.generate on a 4-layer fp32 copy of the shape, with
    chunked prefill and preemption, on the engine's default path (on CUDA: graphs and the
    compiled step, which the check also requires of the startup line)."""
    from lmforge.generate import generate
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    torch.manual_seed(0)
    small = {**kw, "n_layers": 4, "context_length": 128, "vocab_size": 512, "window": 16,
             "dsa_topk": 16}  # fmt: skip
    model = TransformerLM(ModelConfig(**small), device=device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 37, 70)]
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    eng = Engine(model, num_blocks=6, max_num_batched_tokens=32, max_num_seqs=4)
    line = eng.startup_line
    graphs = "CUDA graphs on" in line and "compiled decode step on" in line
    fast = device != "cuda" or graphs
    if not fast:
        print(f"  not the fast path: {line}")
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    same = [o.outputs[0].token_ids for o in outs] == want
    return same and fast and eng.stats["preemptions"] > 0


def _time(eng, prompts, params, device: str, repeats: int) -> float:
    """Median seconds of eng.generate (one warmup run first)."""
    eng.generate(prompts, params)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            eng.generate(prompts, params)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    a = _parser().parse_args()
    if a.quick:
        a.d_model, a.layers, a.heads, a.kv_heads, a.window, a.topk = 128, 4, 4, 2, 16, 8
        a.batch, a.prompt, a.new, a.repeats = 4, 32, 8, 1
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.model_runner import kv_bytes_per_block

    context = a.prompt + a.new + 16
    ok = True
    chosen = {k: v for k, v in PATTERNS.items() if k.replace(" ", "-") in a.patterns.split(",")}
    for name, layers in chosen.items():
        if name.endswith("eager"):
            continue
        good = _check(_kw(a, layers, context), a.device)
        print(f"check {name}: engine greedy == lmforge.generate: {'ok' if good else 'FAILED'}")
        ok &= good
    rows = []
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32000, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for name, layers in chosen.items():
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(**_kw(a, layers, context)), device=a.device,
                              dtype=dtype).eval()  # fmt: skip
        eager = name.endswith("eager")
        eng = Engine(model, max_num_seqs=a.batch, kv_memory_fraction=a.kv_fraction,
                     **({"cuda_graphs": False, "compile": False} if eager else {}))  # fmt: skip
        secs = _time(eng, prompts, params, a.device, a.repeats)
        states = eng.runner.states
        rows.append({
            "kind": name,
            "kv_bytes_per_token": kv_bytes_per_block(model, 16, dtype) // 16,
            "state_bytes_per_seq": 0 if states is None else states.bytes_per_slot(),
            "kv_blocks": eng.runner.num_blocks,
            "tokens_per_s": a.batch * a.new / secs,
            "ms_per_step": 1e3 * secs / a.new,
            "path": eng.startup_line,
        })  # fmt: skip
        del eng, model
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)},
                                                        "rows": rows}, indent=2))  # fmt: skip
    for r in rows:
        print(f"  {r['kind']}: {r['path']}")
    print(f"\nd_model {a.d_model}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv); window "
          f"{a.window}; DSA top-{a.topk}; batch {a.batch} x prompt {a.prompt} + {a.new} new; "
          f"{str(dtype).removeprefix('torch.')}, {a.device}")  # fmt: skip
    print(f"{'kind':<10} {'KV B/token':>11} {'state B/seq':>12} {'KV blocks':>10} {'tok/s':>10} "
          f"{'ms/step':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['kind']:<10} {r['kv_bytes_per_token']:>11} {r['state_bytes_per_seq']:>12} "
              f"{r['kv_blocks']:>10} {r['tokens_per_s']:>10.1f} {r['ms_per_step']:>9.2f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
