"""Hybrid layer patterns through the serving engine (``lmforge.serve.Engine``, its defaults)
against full attention: memory per sequence and batched greedy decode throughput.

Correctness first, on the device (a failed check exits 1; the table still prints): for each
pattern, a 4-layer fp32 copy of the timed shape serves 3 prompts of different lengths through
the engine (chunked prefill, a cache small enough to preempt) and its greedy tokens must equal
``lmforge.generate`` (the reference loop: contiguous KV cache, window masks, recurrent states).

Then, per pattern (random weights, bf16, the engine's own memory sizing at ``--kv-fraction``),
for each batch size of ``--batch`` (one engine serves them all): that many sequences of
``--prompt`` fresh tokens decoding ``--new`` tokens each, added at once; the prefill phase
timed as a whole, then every full-batch decode step on its own (``benchmarks/mla_engine.py``'s
clock: CUDA events, host work between steps included): the median decode step (ms/token of
each sequence) and batch / step tokens/s. Memory per sequence as the engine held it: the most
KV blocks in use after any step × bytes per block / batch (W-only patterns give the blocks
behind the window back, so theirs stays at the window's whatever the context; every request
decodes ``mla_engine.prefill_steps`` extra tokens so that all are running when the timed
steps start, 1.5% of the context at 32 × 32k, counted here too), plus the
recurrent-state bytes per sequence (constant in its length); the KV bytes per token the engine
reports beside it. Every pattern runs the engine's
defaults: CUDA graphs around the compiled decode step (linear layers' slot-state recurrence,
conv-state write and W's window decode as custom ops inside it, :mod:`lmforge.serve.compiled`);
full attention (``A``) is the peer. ``A eager`` and ``GGGA eager`` run the same models without
graphs or compile, so the table splits the gap into graphs+compile and the mixers themselves.
S (DeepSeek sparse attention) selects the top ``--topk`` keys of the lightning indexer inside
the compiled step too. The startup line of each engine (printed above the table) says which path ran.
``--patterns`` picks a subset (each compiled engine costs a compile and a capture).

    PYTHONPATH=src python benchmarks/serve_hybrid.py
    PYTHONPATH=src python benchmarks/serve_hybrid.py --batch 64 --prompt 2048 --out runs/serve_hybrid
    PYTHONPATH=src python benchmarks/serve_hybrid.py --patterns A,GGGA,GGGW --batch 1,32 \
        --prompt 32768 --new 512 --repeats 1        # long context (issue 35)
    PYTHONPATH=src python benchmarks/serve_hybrid.py --patterns A,GGGA,GGGA-eager
    PYTHONPATH=src python benchmarks/serve_hybrid.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch

PATTERNS = {"A": "A", "A eager": "A", "GGGA": "GGGA", "GGGA eager": "GGGA", "MMMA": "MMMA",
            "LLLA": "LLLA", "WWWA": "WWWA", "GMWA": "GMWA", "SSSA": "SSSA", "GGGW": "GGGW",
            "W": "W"}  # fmt: skip


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
    p.add_argument("--batch", default="32", help="comma-separated batch sizes (one engine each)")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.8)
    p.add_argument("--patterns", default="A,A-eager,GGGA,GGGA-eager,MMMA,LLLA,WWWA,GMWA,SSSA",
                   help=f"comma-separated rows to run, of {','.join(k.replace(' ', '-') for k in PATTERNS)}")  # fmt: skip
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


def main() -> int:
    a = _parser().parse_args()
    if a.quick:
        a.d_model, a.layers, a.heads, a.kv_heads, a.window, a.topk = 128, 4, 4, 2, 16, 8
        a.batch, a.prompt, a.new, a.repeats = "1,4", 32, 8, 1
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams
    from lmforge.serve.model_runner import kv_bytes_per_block

    batches = [int(b) for b in str(a.batch).split(",")]
    import mla_engine  # the sibling script (benchmarks/ is on sys.path when one runs)

    context = a.prompt + a.new + 16 + max(mla_engine.prefill_steps(b, a.prompt) for b in batches)
    ok = True
    chosen = {k: v for k, v in PATTERNS.items() if k.replace(" ", "-") in a.patterns.split(",")}
    for name, layers in chosen.items():
        if name.endswith("eager"):
            continue
        t0 = time.perf_counter()
        good = _check(_kw(a, layers, context), a.device)
        print(f"check {name}: engine greedy == lmforge.generate: {'ok' if good else 'FAILED'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        ok &= good
    rows = []
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32000, (a.prompt,), generator=g).tolist()
               for _ in range(max(batches))]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for name, layers in chosen.items():
        torch.manual_seed(0)
        t0 = time.perf_counter()
        model = TransformerLM(ModelConfig(**_kw(a, layers, context)), device=a.device,
                              dtype=dtype).eval()  # fmt: skip
        eager = name.endswith("eager")
        eng = Engine(model, max_num_seqs=max(batches), kv_memory_fraction=a.kv_fraction,
                     **({"cuda_graphs": False, "compile": False} if eager else {}))  # fmt: skip
        states = eng.runner.states
        state = 0 if states is None else states.bytes_per_slot()
        per_block = kv_bytes_per_block(model, eng.block_size, eng.runner.kv_dtype)
        print(f"[{name}] engine built in {time.perf_counter() - t0:.0f} s", flush=True)
        for b in batches:
            t = mla_engine.time_decode(eng, prompts[:b], params, a.device, a.repeats)
            kv_seq = t["peak_blocks"] * per_block / b
            rows.append({
                "kind": name, "batch": b,
                "kv_bytes_per_token": per_block // eng.block_size,
                "kv_bytes_per_seq": kv_seq,
                "state_bytes_per_seq": state,
                "bytes_per_seq": kv_seq + state,
                "kv_blocks": eng.runner.num_blocks,
                "tokens_per_s": b / t["step_ms"] * 1e3,
                "ms_per_step": t["step_ms"],
                "decode_steps_timed": t["steps"],
                "prefill_s": t["prefill_s"],
                "path": eng.startup_line,
            })  # fmt: skip
            r = rows[-1]
            print(f"[{name}, batch {b}] prefill {r['prefill_s']:.1f} s, decode {r['ms_per_step']:.3f}"
                  f" ms/step over {r['decode_steps_timed']} steps, {r['bytes_per_seq'] / 2**20:.2f} "
                  f"MiB/seq; {time.perf_counter() - t0:.0f} s since the build began",
                  flush=True)  # fmt: skip
        mla_engine.save_rows(a, rows)  # after every pattern: a run cut short keeps what it measured
        del eng, model
        if a.device == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        if r["batch"] == batches[0]:
            print(f"  {r['kind']}: {r['path']}")
    print(f"\nd_model {a.d_model}, {a.layers} layers, {a.heads} heads ({a.kv_heads} kv); window "
          f"{a.window}; DSA top-{a.topk}; prompt {a.prompt} + {a.new} new; "
          f"{str(dtype).removeprefix('torch.')}, {a.device}")  # fmt: skip
    print(
        "decode step = median of every full-batch decode step (prefill excluded, timed apart); "
        "MiB/seq = the most KV blocks held / batch + recurrent state"
    )
    print(f"{'kind':<10} {'batch':>5} {'KV B/token':>11} {'MiB/seq':>9} {'state MiB':>9} "
          f"{'tok/s':>10} {'ms/step':>9} {'vs A':>6} {'prefill s':>9}")  # fmt: skip
    base = {r["batch"]: r["ms_per_step"] for r in rows if r["kind"] == "A"}
    for r in rows:
        rel = f"{r['ms_per_step'] / base[r['batch']]:>5.2f}x" if r["batch"] in base else "     -"
        print(f"{r['kind']:<10} {r['batch']:>5} {r['kv_bytes_per_token']:>11} "
              f"{r['bytes_per_seq'] / 2**20:>9.2f} {r['state_bytes_per_seq'] / 2**20:>9.2f} "
              f"{r['tokens_per_s']:>10.1f} {r['ms_per_step']:>9.3f} {rel} "
              f"{r['prefill_s']:>9.2f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
