"""The engine on the model's one forward against a baseline checkout (the three-forward engine).

Correctness first, per checkout, on a small fp32 model: the engine's greedy tokens equal
``lmforge.generate``'s for a plain model and for a muP model (the old serving forwards dropped
muP's q scale and output multiplier, so the baseline is expected to fail that row). Then decode
timing on a TinyLlama-1.1B-shaped bf16 model (random weights): the engine with CUDA graphs and
the compiled decode step (passed explicitly, so both checkouts run the same configuration),
ms per decode step at batch 1 and batch 64 from the engine's own step timers (wall time of
``Engine.step``, host included), median of ``--reps`` runs. Each checkout runs in its own
process (``PYTHONPATH`` = its ``src``); the table comes last.

    python benchmarks/engine_forward.py --baseline-src ../main/src --out /tmp/engine_forward
    python benchmarks/engine_forward.py --device cpu --quick   # smoke run, no baseline

Not yet run on a GPU; expected to take a few minutes per checkout on an H200 (compiles dominate).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parents[1] / "src"


def _child(args: argparse.Namespace) -> dict:
    import torch

    from lmforge.generate import generate
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    dev = torch.device(args.device)
    fast = dict(cuda_graphs=True, compile=True) if dev.type == "cuda" else {}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    checks = {}
    for name, kw in (
        ("plain", {}),
        ("muP", dict(mup=True, mup_base_width=64, mup_base_head_dim=16)),
    ):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=257, context_length=128, d_model=256, n_layers=2,
                          n_heads=4, n_kv_heads=2, **kw)  # fmt: skip
        model = TransformerLM(cfg, device=dev).eval()
        prompts = [[1, 2, 3, 4, 5], list(range(10, 47))]
        want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
        eng = Engine(model, block_size=16, num_blocks=32, max_num_seqs=8, **fast)
        got = [o.outputs[0].token_ids for o in eng.generate(prompts, greedy)]
        checks[name] = got == want
        del eng, model
    if dev.type == "cuda":
        cfg = ModelConfig(vocab_size=32000, context_length=2048, d_model=2048, n_layers=22,
                          n_heads=32, n_kv_heads=4, d_ff=5632, rope_theta=10000.0)  # fmt: skip
    else:
        cfg = ModelConfig(vocab_size=512, context_length=256, d_model=128, n_layers=2, n_heads=4)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = TransformerLM(cfg, device=dev, dtype=dtype).eval()
    n_tok = 32 if args.quick else 128
    eng = Engine(model, block_size=16, num_blocks=2048 if dev.type == "cuda" else 256,
                 max_num_seqs=64, **fast)  # fmt: skip
    timing = {}
    for batch in (1, 64):
        runs = []
        for rep in range(args.reps + 1):  # the first run warms up
            prompts = [
                [(7 * i + j + rep) % cfg.vocab_size for j in range(64)] for i in range(batch)
            ]
            before = (eng.stats["decode_s"], eng.stats["decode_steps"])
            eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True))
            steps = eng.stats["decode_steps"] - before[1]
            if rep:
                runs.append((eng.stats["decode_s"] - before[0]) / max(steps, 1) * 1e3)
        timing[batch] = statistics.median(runs)
    return {"checks": checks, "ms_per_step": timing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--baseline-src", default=None, help="another checkout's src/ (the peer)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer decode steps")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write results.json here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args)))
        return 0
    trees = [("this checkout", str(HERE))]
    if args.baseline_src:
        trees.append(("baseline", str(pathlib.Path(args.baseline_src).resolve())))
    results = {}
    for name, src in trees:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--device",
            args.device,
            "--reps",
            str(args.reps),
        ]
        cmd += ["--quick"] if args.quick else []
        env = {**os.environ, "PYTHONPATH": src}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not line:
            print(f"{name}: failed\n{done.stderr[-3000:]}")
            return 1
        results[name] = json.loads(line[-1][len("RESULT ") :])
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(out / "results.json")
    print(f"\nengine decode, {args.device}, CUDA graphs + compiled step; ms per decode step "
          f"(median of {args.reps})\n")  # fmt: skip
    print("| checkout | greedy == generate (plain) | (muP) | batch 1 ms/step | batch 64 ms/step |")
    print("|---|---|---|---:|---:|")
    for name, r in results.items():
        c, t = r["checks"], r["ms_per_step"]
        print(f"| {name} | {c['plain']} | {c['muP']} | {t['1']:.3f} | {t['64']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
