"""MLA and MLA + CLA against GQA through the serving engine (``lmforge.serve.Engine``, its
defaults): KV blocks that fit, and batched greedy decode throughput.

Correctness first, on the device (a failed check exits 1; the table still prints): for each
attention kind, a 2-layer fp32 copy of the timed shape serves 3 prompts of different lengths
through the engine (chunked prefill, prefix caching on) and its greedy tokens must equal
``lmforge.generate`` (the reference loop over a contiguous KV cache).

Then, per kind (random weights, bf16, the engine's own memory sizing at
``--kv-fraction``): the KV bytes per token (``lmforge.model.cla.kv_bytes_per_token``), the
blocks the engine allocated, and ``--batch`` sequences of ``--prompt`` tokens decoding
``--new`` tokens each: median over ``--repeats`` runs (after one warmup run) of the wall time
of ``Engine.generate`` between CUDA events, as generated tokens/s and ms per decode step
(prefill included, the same for every kind). Every kind runs the engine's defaults: CUDA
graphs around the compiled decode step (for MLA the latent write and the Triton latent decode
kernel, ``lmforge.kernels.mla_decode``, are one custom op inside it); each engine's startup
line, printed above the table, says which path ran, and the correctness check requires it.

    PYTHONPATH=src python benchmarks/mla_engine.py
    PYTHONPATH=src python benchmarks/mla_engine.py --batch 64 --prompt 2048 --new 128 --out runs/mla_engine
    PYTHONPATH=src python benchmarks/mla_engine.py --device cpu --quick
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
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.8)
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
        a.d_model, a.layers, a.heads, a.kv_heads = 128, 2, 4, 2
        a.kv_lora_rank, a.rope_dim, a.batch, a.prompt, a.new, a.repeats = 64, 16, 4, 32, 8, 1
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    configs = _configs(a, a.prompt + a.new + 16)
    ok = True
    for name, kw in configs.items():
        good = _check(kw, a.device)
        print(f"check {name}: engine greedy == lmforge.generate: {'ok' if good else 'FAILED'}")
        ok &= good
    rows = []
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32000, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    for name, kw in configs.items():
        torch.manual_seed(0)
        cfg = ModelConfig(**kw)
        model = TransformerLM(cfg, device=a.device, dtype=dtype).eval()
        eng = Engine(model, max_num_seqs=a.batch, kv_memory_fraction=a.kv_fraction)
        secs = _time(eng, prompts, params, a.device, a.repeats)
        rows.append({
            "kind": name,
            "kv_bytes_per_token": _kv_bytes(cfg),
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
    print(f"\nd_model {a.d_model}, {a.layers} layers, {a.heads} heads; batch {a.batch} x prompt "
          f"{a.prompt} + {a.new} new; {str(dtype).removeprefix('torch.')}, {a.device}")  # fmt: skip
    print(f"{'kind':<12} {'KV B/token':>11} {'KV blocks':>10} {'tok/s':>10} {'ms/step':>9}")
    for r in rows:
        print(f"{r['kind']:<12} {r['kv_bytes_per_token']:>11} {r['kv_blocks']:>10} "
              f"{r['tokens_per_s']:>10.1f} {r['ms_per_step']:>9.2f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
